"""``medload export-nnunet``: a store's labelled series as an nnU-Net v2 raw dataset."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click

from medload.cli.app import cli, short


@cli.command(name="export-nnunet")
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dataset-id", type=click.IntRange(1, 999), required=True,
              help="nnU-Net dataset id: the folder is OUT/DatasetNNN_NAME.")
@click.option("--name", required=True, help="Dataset name (letters, digits, '_' and '-').")
@click.option("--query", default=None,
              help="Series to export, a pandas query on the catalog, e.g. \"kernel == 'B30f'\" (default: all).")
@click.option("--label-map", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help='JSON {"liver": ["Liver", "LIVER_1"], ...}: exported class k is the k-th key, made of the stored '
                   "classes of those names (default: the stored classes, where every series numbers them alike).")
@click.option("--folds", type=click.IntRange(min=2), default=5, show_default=True,
              help="Cross-validation folds of splits_final.json, split by patient.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the patients' draw into folds.")
def export_nnunet(store: Path, out: Path, dataset_id: int, name: str, query: str | None, label_map: Path | None,
                  folds: int, seed: int) -> None:
    """Write the labelled series of STORE as an nnU-Net v2 raw dataset in OUT (the nnUNet_raw folder):
    imagesTr/, labelsTr/, dataset.json, splits_final.json (folds by patient), medload_cases.json and
    medload_lineage.json (the lineage record: `medload lineage check`)."""
    from medload.export.nnunet import export_nnunet as export

    result = export(store, out, dataset_id=dataset_id, name=name, query=query, label_map=_read_label_map(label_map),
                    folds=folds, seed=seed)
    patients = {c.patient for c in result.cases}
    per_fold = Counter(c.fold for c in result.cases)
    click.echo(f"wrote {result.path}: {len(result.cases)} case(s) of {len(patients)} patient(s); labels "
               + ", ".join(f"{n}={i}" for n, i in result.labels.items())
               + "; cases per fold " + ", ".join(str(per_fold[f]) for f in range(folds)))
    click.echo(f"lineage record {result.path / 'medload_lineage.json'} (digest {result.lineage[:12]})")
    for key, reason in result.left_out:
        click.echo(f"left out  series {short(key)}: {reason}")
    for note in result.notes:
        click.echo(f"note  {note}")


def _read_label_map(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise click.BadParameter(f'{path} must hold JSON {{"class": ["stored class name", ...]}} ({exc})',
                                 param_hint="--label-map") from None
