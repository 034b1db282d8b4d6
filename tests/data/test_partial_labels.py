"""Datasets over a partly labelled store: labels="only" keeps the labelled series and says how many it left
out; a class map gives the label values one meaning, and series whose values disagree are never merged quietly."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers.labelled_store import LIVER_AND_SPLEEN, LIVER_ONLY, make_partly_labelled_store

from medload.data import SlabDataset, SliceDataset
from medload.data.labelling import parse_classes
from medload.errors import ConfigError
from medload.storage.store import open_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(make_partly_labelled_store(tmp_path_factory.mktemp("partly")))


def _keys(store, classes: dict | None) -> list[str]:
    """The series whose stored classes are ``classes`` (None: the unlabelled ones)."""
    return [r.key for r in store.series() if (None if (lab := store.labels(r.key)) is None else lab.classes) == classes]


def test_labels_only_keeps_the_labelled_series_and_says_how_many_it_left_out(store, caplog):
    unlabelled = _keys(store, None)
    with caplog.at_level(logging.INFO, logger="medload.data.labelling"):
        ds = SliceDataset(store, context=1, labels="only", keys=[r.key for r in store.series()], classes=["liver"])
    assert ds.labels and len(ds.records) == 6 and len(ds) == 36 and sorted(ds.unlabelled) == sorted(unlabelled)
    assert "3 of 9 selected series" in caplog.text and "left out" in caplog.text
    assert ds[0]["label"].shape == (1, 32, 40)
    slabs = SlabDataset(store, depth=4, stride=2, labels="only", classes=["liver"])
    assert len(slabs.records) == 6 and len(slabs.unlabelled) == 3


def test_without_only_a_partly_labelled_selection_names_the_option(store):
    with pytest.warns(UserWarning, match="3 of 9 series .* have no labels, so the dataset has none: pass labels='only'"):
        assert not SliceDataset(store).labels
    with pytest.raises(ConfigError, match="3 of 9 series have no labels: pass labels='only'"):
        SliceDataset(store, labels=True)
    with pytest.raises(ConfigError, match="no labels"):
        SliceDataset(store, labels="only", keys=_keys(store, None))
    with pytest.raises(ConfigError, match="labels must be None, True, False or 'only'"):
        SliceDataset(store, labels="yes")
    with pytest.raises(ConfigError, match="has no labels: pass labels='only'"):
        SliceDataset(store, labels=False, classes=["liver"])


def test_values_that_mean_different_classes_are_warned_about_not_merged_quietly(store):
    with pytest.warns(UserWarning, match=r"value 1 is 'Liver' in 4 series and 'Spleen' in 2 series.*classes="):
        ds = SliceDataset(store, labels="only")
    assert ds.class_names is None
    liver_only = SliceDataset(store, labels="only", keys=_keys(store, {"1": "Liver"}))  # one numbering: no warning
    assert liver_only.class_names == {1: "Liver"}


def test_a_class_map_gives_every_series_one_numbering(store):
    ds = SliceDataset(store, context=0, labels="only", classes=["liver", "spleen"])
    assert ds.class_names == {1: "liver", 2: "spleen"}
    both = _keys(store, {"1": "Spleen", "2": "Liver"})
    for i in range(len(ds)):
        item = ds[i]
        stored = ds.store.read_label(item["key"], item["z"], item["z"] + 1)
        expected = np.choose(stored, [0, 2, 1]) if item["key"] in both else stored  # Spleen 1 -> 2, Liver 2 -> 1
        assert np.array_equal(item["label"].numpy(), expected)
    assert {v for i in range(len(ds)) for v in np.unique(ds[i]["label"].numpy()).tolist()} == {0, 1, 2}
    # foreground (ForegroundSampler) counts only the classes the map keeps: spleen is on slices 2..4 of 2 series
    assert int(SliceDataset(store, context=0, labels="only", classes=["spleen"]).foreground.sum()) == 2 * 3
    assert int(ds.foreground.sum()) == len(LIVER_ONLY) * 4 + len(LIVER_AND_SPLEEN) * 4  # liver on slices 1..4


def test_merging_is_asked_for_and_unknown_classes_are_warned_about(store):
    merged = SliceDataset(store, context=0, labels="only", classes={"organs": ["Liver", "Spleen"]})
    assert merged.class_names == {1: "organs"}
    assert {v for i in range(len(merged)) for v in np.unique(merged[i]["label"].numpy()).tolist()} == {0, 1}
    with pytest.warns(UserWarning, match=r"classes \['livr'\] match no stored class .*stored: Liver, Spleen"):
        SliceDataset(store, context=0, labels="only", classes=["livr", "spleen"])


def test_the_command_line_form_of_a_class_map():
    assert parse_classes("liver,spleen") == {"liver": ["liver"], "spleen": ["spleen"]}
    assert parse_classes("organs=Liver+Spleen, bone") == {"organs": ["Liver", "Spleen"], "bone": ["bone"]}
    for bad in ("", "liver,,spleen", "a=", "liver,liver"):
        with pytest.raises(ConfigError, match="--classes"):
            parse_classes(bad)


def test_patches_keep_the_labelled_series_as_the_other_datasets(store):
    """PatchDataset takes labels='only' and the filters' explanations by the same rule (medload.data.labelling)."""
    from medload.data import PatchDataset

    ds = PatchDataset(store, patch=(2, 8, 8), spacing=None, labels="only", samples_per_epoch=4)
    assert ds.labels and len(ds.records) == 6 and len(ds.unlabelled) == 3
    assert "label" in ds[0]
    with pytest.raises(ConfigError, match=r"modality='MR' matched 0 of 9"):
        PatchDataset(store, patch=(2, 8, 8), modality="MR")
