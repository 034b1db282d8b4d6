"""Click options several commands share, with one wording and one type each: the pseudonymisation key
(``ingest``, ``repair``, ``push-seg``; a command gets them as one ``key_file``, a ``KeyFile``) and the
DICOMweb connection (``ingest`` from a PACS, ``push-seg`` to it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import click


def _key_options(*, new: bool) -> Callable[[Callable], Callable]:
    """``--key-file`` and ``--allow-shared-key`` (and, for ingest, ``--new-key``), given to the command as one
    ``key_file`` argument: a :class:`~medload.deid.KeyFile`."""
    options = [
        click.option("--key-file", type=click.Path(path_type=Path), default=None,
                     help="The store's pseudonymisation key (default $MEDLOAD_KEY_FILE or "
                          "~/.config/medload/pseudonym.key)."),
        click.option("--allow-shared-key", is_flag=True,
                     help="Use a key file other users may read, with a warning (refused otherwise: chmod 600 it)."),
    ]
    if new:
        options.append(click.option(
            "--new-key", is_flag=True,
            help="Create a new key at --key-file (or $MEDLOAD_KEY_FILE) if no file is there, for a new store; "
                 "without it that path must exist (only the default path is created unasked)."))

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def with_key_file(*args, key_file: Path | None, allow_shared_key: bool, new_key: bool = False, **kwargs):
            from medload.deid import KeyFile

            return command(*args, key_file=KeyFile(key_file, new=new_key, allow_shared=allow_shared_key), **kwargs)

        for option in reversed(options):
            with_key_file = option(with_key_file)
        return with_key_file

    return decorate


#: the key options of a command that reads or writes an existing store (``repair``, ``push-seg``)
key_file_option = _key_options(new=False)
#: the key options of ``ingest``, which may start a new store and so a new key
ingest_key_options = _key_options(new=True)

credentials_option = click.option(
    "--credentials", type=click.Path(path_type=Path), default=None,
    help="dicomweb://: file (mode 0600) holding user:password or a bearer token; else the MEDLOAD_DICOMWEB_USER "
         "and MEDLOAD_DICOMWEB_PASSWORD, or MEDLOAD_DICOMWEB_TOKEN, variables.")

ca_bundle_option = click.option(
    "--ca-bundle", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
    help="dicomwebs://: PEM certificates of the CA that signed the server's (verification is always on).")
