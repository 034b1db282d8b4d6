"""``medload share``: who may read a store (see :mod:`medload.storage.sharing`)."""

from __future__ import annotations

from pathlib import Path

import click

from medload.cli.app import cli


@cli.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--group", "group", default=None, metavar="NAME",
              help="Share with group NAME (you must be a member); without it, with the group of STORE's folder.")
@click.option("--private", is_flag=True, help="Make STORE its owner's only again.")
def share(store: Path, group: str | None, private: bool) -> None:
    """Let a group read STORE (files 0640, folders 0750), or with --private its owner only (0600/0700).
    The setting is recorded in STORE/store.json and every later ingest, compact and repair keeps it."""
    from medload.storage.manifest import read_manifest
    from medload.storage.writer import StoreWriter

    if private and group is not None:
        raise click.UsageError("--group and --private are opposites: give one")
    setting = "private" if private else f"group:{group}" if group else "group"
    manifest = read_manifest(store)
    with StoreWriter(store, codec=manifest.codec, windows=tuple(manifest.windows),
                     key_fingerprint=manifest.key_fingerprint, share=setting) as writer:
        gid = writer.sharing.gid
    if private:
        click.echo(f"{store}: its owner's only (files 0600, folders 0700)")
    else:
        import grp

        name = grp.getgrgid(gid).gr_name if gid is not None else "its files' group"
        click.echo(f"{store}: readable by group {name} (files 0640, folders 0750); its owner writes")
