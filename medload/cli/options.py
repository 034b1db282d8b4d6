"""Click options several commands share, with one wording and one type each: the pseudonymisation key
(``ingest``, ``repair``, ``push-seg``) and the DICOMweb connection (``ingest`` from a PACS, ``push-seg`` to it)."""

from __future__ import annotations

from pathlib import Path

import click

key_file_option = click.option(
    "--key-file", type=click.Path(path_type=Path), default=None,
    help="The store's pseudonymisation key (default $MEDLOAD_KEY_FILE or ~/.config/medload/pseudonym.key).")

credentials_option = click.option(
    "--credentials", type=click.Path(path_type=Path), default=None,
    help="dicomweb://: file (mode 0600) holding user:password or a bearer token; else the MEDLOAD_DICOMWEB_USER "
         "and MEDLOAD_DICOMWEB_PASSWORD, or MEDLOAD_DICOMWEB_TOKEN, variables.")

ca_bundle_option = click.option(
    "--ca-bundle", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
    help="dicomwebs://: PEM certificates of the CA that signed the server's (verification is always on).")
