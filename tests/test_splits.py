"""Group-level splits (`oj.split`): whole groups per split, about the fractions asked, the same file for
the same seed, listed and checksummed in the manifest without changing the fingerprint, read back by
every loader through ``rows=ds.split(name)``; bad arguments and a damaged sidecar are one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import run_as_nobody
from hypothesis import given, settings
from hypothesis import strategies as st

import omicsio_jax as oj
from omicsio_jax.dataset.splits import _ends


@pytest.fixture
def ds_path(dataset_dir, tmp_path):
    """A copy of the session's dataset: splits are written into it."""
    return shutil.copytree(dataset_dir, tmp_path / "ds")


def test_whole_groups_go_to_one_split_each_about_their_fraction(ds_path):
    ds = oj.open_dataset(ds_path)
    fingerprint = ds.fingerprint
    result = oj.split(ds, by="drug", fractions=(0.8, 0.1, 0.1), seed=3)
    rows = {name: ds.split(name) for name in ("train", "val", "test")}
    labels = ds.obs["drug"].labels()
    assert sum(len(r) for r in rows.values()) == ds.num_cells  # every cell in exactly one split
    assert len(np.unique(np.concatenate(list(rows.values())))) == ds.num_cells
    for name, r in rows.items():
        assert set(labels[r]) == set(result.groups[name])  # whole groups: no drug in two splits
        assert len(r) == result.cells[name]
    assert abs(len(rows["train"]) / ds.num_cells - 0.8) < 0.1  # 30 drugs of ~100 cells each
    assert all(result.groups.values())

    again = oj.open_dataset(ds_path)  # listed in the manifest, read back, fingerprint unchanged
    assert again.fingerprint == fingerprint
    assert any(f.path == "splits/drug.json" for f in again.manifest.files)
    np.testing.assert_array_equal(again.split("val"), rows["val"])
    assert oj.verify_dataset(ds_path) == []  # the sidecar checked like every file


def test_the_same_seed_gives_the_same_file_and_another_seed_another_split(ds_path, tmp_path):
    ds = oj.open_dataset(ds_path)
    oj.split(ds, by="drug", seed=0, fractions=(0.5, 0.5), names=("a", "b"))
    first = (ds_path / "splits" / "drug.json").read_bytes()
    oj.split(ds, by="drug", seed=0, fractions=(0.5, 0.5), names=("a", "b"))  # the same: kept
    assert (ds_path / "splits" / "drug.json").read_bytes() == first
    other = shutil.copytree(ds_path, tmp_path / "other")
    oj.split(
        oj.open_dataset(other), by="drug", seed=1, fractions=(0.5, 0.5), names=("a", "b"), overwrite=True
    )
    assert json.loads((other / "splits" / "drug.json").read_text())["groups"] != json.loads(first)["groups"]
    with pytest.raises(oj.OmicsIOError, match="holds another split by 'drug'; pass overwrite=True"):
        oj.split(ds, by="drug", seed=1, fractions=(0.5, 0.5), names=("a", "b"))
    (other / "splits" / "drug.json").unlink()  # removed by hand: still listed in the manifest
    with pytest.raises(
        oj.OmicsIOError, match="drug.json is listed in the manifest but missing: it held a split by 'drug'"
    ):
        oj.split(oj.open_dataset(other), by="drug", seed=1, fractions=(0.5, 0.5), names=("a", "b"))


def test_every_loader_serves_only_its_split(ds_path):
    ds = oj.open_dataset(ds_path)
    oj.split(ds, by="tissue", fractions=(0.7, 0.3), names=("train", "held_out"), seed=0)
    train = ds.split("train")
    loader = oj.make_loader(ds, batch_size=64, rows=train, num_epochs=1, output="csr", seed=0)
    served = np.concatenate([np.asarray(b.index)[np.asarray(b.mask)] for b in loader])
    held_out = set(ds.obs["tissue"].labels()[ds.split("held_out")])
    assert set(served) <= set(train.tolist())
    assert not set(ds.obs["tissue"].labels()[served]) & held_out


def test_two_splits_are_named_by_their_obs(ds_path):
    ds = oj.open_dataset(ds_path)
    oj.split(ds, by="drug", fractions=(0.5, 0.5), names=("a", "b"))
    oj.split(ds, by="tissue", fractions=(0.5, 0.5), names=("a", "b"))
    with pytest.raises(oj.OmicsIOError, match="has splits by 'drug', 'tissue': name one with by="):
        ds.split("a")
    assert set(ds.obs["tissue"].labels()[ds.split("a", by="tissue")]).isdisjoint(
        ds.obs["tissue"].labels()[ds.split("b", by="tissue")]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"by": "drug", "fractions": (0.5, 0.4, 0.05)},
            r"must be non-negative and sum to 1 \(they sum to 0.95\)",
        ),
        ({"by": "drug", "fractions": (0.5, 0.5)}, r"must pair up"),
        ({"by": "donor"}, r"no obs 'donor'; obs: cell_type"),
        ({"by": "total_counts"}, r"obs 'total_counts' is numeric"),
        (
            {"by": "batch", "fractions": (0.98, 0.01, 0.01)},
            r"2 group\(s\) of 'batch' cannot give each of the 3 splits 0.98/0.01/0.01 a group",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors_and_write_nothing(ds_path, kwargs, message):
    ds = oj.open_dataset(ds_path)
    before = (ds_path / "manifest.json").read_bytes()
    with pytest.raises(oj.OmicsIOError, match=message) as caught:
        oj.split(ds, **kwargs)
    assert "\n" not in str(caught.value)
    assert (ds_path / "manifest.json").read_bytes() == before and not (ds_path / "splits").exists()


def test_a_missing_unknown_or_damaged_split_is_a_one_line_error(ds_path):
    ds = oj.open_dataset(ds_path)
    with pytest.raises(oj.OmicsIOError, match=r"has no split; write one with oj.split"):
        ds.split("train")
    oj.split(ds, by="drug", fractions=(0.8, 0.1, 0.1))
    with pytest.raises(
        oj.OmicsIOError, match=r"no split 'training' in splits/drug.json: its splits are 'train'"
    ):
        ds.split("training")
    with pytest.raises(oj.OmicsIOError, match=r"has no split by 'tissue'"):
        ds.split("train", by="tissue")
    sidecar = ds_path / "splits" / "drug.json"
    whole = sidecar.read_text()
    sidecar.write_text(whole.replace('"train"', '"tr"', 1))  # another size: refused as it is opened
    with pytest.raises(
        oj.DatasetFormatError, match=r"its file splits/drug.json is damaged: .* the manifest says"
    ):
        oj.open_dataset(ds_path).split("train")
    sidecar.write_text(whole.replace('"train"', '"trian"', 1))  # the same size: by its checksum
    with pytest.raises(oj.DatasetFormatError, match=r"does not match its checksum in the manifest"):
        oj.open_dataset(ds_path).split("train")


def test_a_dataset_on_read_only_storage_reads_its_splits_and_refuses_a_new_one_in_one_line(
    dataset_dir, shared_dir
):
    """A dataset another user wrote (a shared atlas): its split is read; a new one cannot be written
    beside it, which the error says with what to do (it was a PermissionError on a hidden file)."""
    path = shutil.copytree(dataset_dir, shared_dir / "ds")
    oj.split(oj.open_dataset(path), by="drug", fractions=(0.8, 0.1, 0.1))
    before = (path / "manifest.json").read_bytes()
    code = f"""
import omicsio_jax as oj
ds = oj.open_dataset({str(path)!r})
print(len(ds.split("val")))
try:
    oj.split(ds, by="cell_type", fractions=(0.5, 0.5), names=("a", "b"))
except oj.OmicsIOError as e:
    print(e)
"""
    out = run_as_nobody(code)
    assert out.returncode == 0, out.stderr
    rows, message = out.stdout.strip().split("\n")
    assert int(rows) == len(oj.open_dataset(path).split("val"))
    assert message == (
        f"oj.split({path}, by='cell_type'): cannot write splits/cell_type.json into {path} (Permission "
        "denied); split a copy you can write, or ask the dataset's owner to run oj.split"
    )
    assert (path / "manifest.json").read_bytes() == before


def test_a_split_the_folder_refuses_is_a_one_line_error_and_changes_nothing(
    dataset_dir, tmp_path, monkeypatch
):
    """The same refusal in this process (where another user cannot run): the folder refuses the
    split's file as a read-only mount or another user's folder does."""
    import pathlib

    path = shutil.copytree(dataset_dir, tmp_path / "ds")
    before = (path / "manifest.json").read_bytes()
    write_text = pathlib.Path.write_text

    def refused(self, *args, **kwargs):
        if self.parent.name == "splits":
            raise PermissionError(13, "Permission denied", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", refused)
    with pytest.raises(oj.OmicsIOError) as caught:
        oj.split(oj.open_dataset(path), by="drug", fractions=(0.8, 0.2), names=("a", "b"))
    assert str(caught.value) == (
        f"oj.split({path}, by='drug'): cannot write splits/drug.json into {path} (Permission denied); "
        "split a copy you can write, or ask the dataset's owner to run oj.split"
    )
    assert (path / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("seed", range(8))
def test_five_donors_split_three_ways_give_every_split_a_donor_whatever_the_seed(seed):
    """Five donors of about a fifth each, 0.6/0.2/0.2: a group goes where its middle cell falls, and
    every split asked for gets a group (cut where the first cells fall, seeds 0, 2, 3, 5 and 6 left
    the test split empty)."""
    sizes = np.array([539, 501, 488, 494, 478])[np.random.default_rng(seed).permutation(5)]
    ends = _ends(sizes, (0.6, 0.2, 0.2))
    assert ends == [3, 4, 5]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30),
    weights=st.lists(st.integers(0, 20), min_size=1, max_size=5).filter(any),
)
def test_each_split_asked_for_gets_a_group_and_the_cuts_are_runs(sizes, weights):
    fractions = [w / sum(weights) for w in weights]
    wanted = sum(f > 0 for f in fractions)
    if len(sizes) < wanted:
        return  # refused by oj.split before the cut
    ends = _ends(np.array(sizes, np.int64), fractions)
    starts = [0, *ends[:-1]]
    assert ends[-1] == len(sizes) and all(a <= b for a, b in zip(starts, ends, strict=True))
    for f, a, b in zip(fractions, starts, ends, strict=True):
        assert (b > a) if f > 0 else (b == a)


def test_two_splits_written_at_once_both_stay_listed(ds_path, monkeypatch):
    """Each split replaces the manifest with its own entry added: one written while another was
    between reading and replacing the manifest was dropped from it (its sidecar left unlisted)."""
    import threading
    import time

    from omicsio_jax.dataset import splits

    read = splits.read_manifest
    reading = threading.Event()

    def slow_read(root):  # the first split stays between reading and replacing the manifest
        m = read(root)
        if threading.current_thread().name == "first":
            reading.set()
            time.sleep(0.5)
        return m

    monkeypatch.setattr(splits, "read_manifest", slow_read)
    first = threading.Thread(
        name="first",
        target=lambda: oj.split(oj.open_dataset(ds_path), by="drug", fractions=(0.5, 0.5), names=("a", "b")),
    )
    first.start()
    assert reading.wait(30)
    oj.split(oj.open_dataset(ds_path), by="tissue", fractions=(0.5, 0.5), names=("a", "b"))
    first.join()
    ds = oj.open_dataset(ds_path)
    assert {f.path for f in ds.manifest.files if f.path.startswith("splits/")} == {
        "splits/drug.json",
        "splits/tissue.json",
    }
    assert len(ds.split("a", by="drug")) and len(ds.split("a", by="tissue"))
    assert oj.verify_dataset(ds_path) == []


def test_a_split_written_again_since_a_handle_opened_is_refused_saying_to_open_again(ds_path):
    """A handle opened before another (another process) wrote its split again with other groups: not
    'damaged, write it again', which verify contradicts; it is told to open the dataset again, and
    does not mix the old split's rows with the new one's."""
    ds = oj.open_dataset(ds_path)
    oj.split(ds, by="drug", fractions=(0.5, 0.5), names=("a", "b"), seed=0)
    old = ds.split("a")  # read: this handle checks the sidecar by its checksum from now on
    unread = oj.open_dataset(ds_path)  # opened, the sidecar not read: checked by its size first
    oj.split(
        oj.open_dataset(ds_path), by="drug", fractions=(0.5, 0.5), names=("a", "bb"), seed=1, overwrite=True
    )
    for handle in (ds, unread):
        with pytest.raises(oj.OmicsIOError, match=r"written again by oj.split .* open it again") as caught:
            handle.split("a")
        assert "\n" not in str(caught.value)
    again = oj.open_dataset(ds_path)
    assert not np.array_equal(again.split("a"), old)
    oj.split(oj.open_dataset(ds_path), by="tissue", fractions=(0.5, 0.5), names=("a", "b"))
    with pytest.raises(oj.OmicsIOError, match=r"has no split by 'tissue'.*written since this handle opened"):
        again.split("a", by="tissue")
    assert oj.verify_dataset(ds_path) == []


def test_statistics_added_meanwhile_keep_a_split_written_during_their_run(ds_path, monkeypatch):
    """``omicsio-materialize stats`` replaces the manifest with the one it opened plus its files: a split
    `oj.split` wrote (or wrote again) while the statistics were computed was dropped from it."""
    from materialize import _stats

    oj.split(oj.open_dataset(ds_path), by="tissue", fractions=(0.5, 0.5), names=("a", "b"), seed=0)
    add_files = _stats._add_files

    def with_splits_meanwhile(root, ds, progress):  # as another process would, mid-run
        m = add_files(root, ds, progress)
        oj.split(oj.open_dataset(ds_path), by="drug", fractions=(0.5, 0.5), names=("a", "b"))
        oj.split(
            oj.open_dataset(ds_path),
            by="tissue",
            fractions=(0.5, 0.5),
            names=("a", "b"),
            seed=1,
            overwrite=True,
        )
        return m

    monkeypatch.setattr(_stats, "_add_files", with_splits_meanwhile)
    _stats.add_stats(ds_path, force=True, progress=False)
    ds = oj.open_dataset(ds_path)
    assert {f.path for f in ds.manifest.files if f.path.startswith("splits/")} == {
        "splits/drug.json",
        "splits/tissue.json",
    }
    assert len(ds.split("a", by="drug")) and len(ds.split("a", by="tissue"))  # the checksums as written
    assert oj.verify_dataset(ds_path) == []


def test_a_split_read_while_another_rewrites_it_waits_for_the_rewrite_to_be_listed(ds_path, monkeypatch):
    """A rewrite replaces the sidecar, then the manifest: a handle reading the split in between saw the
    new sidecar against the old checksum and called it damaged ('write it again'); it now waits for
    the rewrite's lock and says the split was written again."""
    import threading

    from omicsio_jax.dataset import splits

    ds = oj.open_dataset(ds_path)
    oj.split(ds, by="drug", fractions=(0.5, 0.5), names=("a", "b"), seed=0)
    ds.split("a")
    fsync, between, go_on = splits.fsync_path, threading.Event(), threading.Event()

    def paused(path):  # the rewrite stops after its sidecar is in place, before its manifest is
        fsync(path)
        if str(path).endswith(".tmp") and "manifest" in str(path):
            between.set()
            go_on.wait(30)

    monkeypatch.setattr(splits, "fsync_path", paused)
    writer = threading.Thread(
        target=lambda: oj.split(
            oj.open_dataset(ds_path),
            by="drug",
            fractions=(0.5, 0.5),
            names=("a", "b"),
            seed=1,
            overwrite=True,
        )
    )
    writer.start()
    assert between.wait(30)
    threading.Timer(0.3, go_on.set).start()  # the reader below waits on the lock until then
    with pytest.raises(oj.OmicsIOError, match=r"written again by oj.split .* open it again"):
        ds.split("a")
    writer.join()
