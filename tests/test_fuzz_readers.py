"""The readers of what a run finds on disk, fuzzed: any malformed ``manifest.json`` or loader state
is a one-line error of the project's own type, never a traceback from deep inside a reader."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omicsio_jax as oj
from omicsio_jax.format.manifest import Manifest, parse_manifest

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _mutated(data, original):
    """``original`` with one value somewhere in it replaced by any JSON value, or one key removed."""
    obj = copy.deepcopy(original)
    parent, key, node = None, None, obj
    while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 3)) > 0:
        parent, key = (
            node,
            data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node)))),
        )
        node = node[key]
    if parent is None:
        return data.draw(JSON)
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = data.draw(JSON)
    return obj


@pytest.fixture(scope="module")
def manifest_dict(dataset_dir):
    return json.loads((dataset_dir / "manifest.json").read_text())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_manifest_is_one_line(manifest_dict, data):
    text = json.dumps(_mutated(data, manifest_dict))
    try:
        manifest = parse_manifest(text, "ds/manifest.json")
    except oj.DatasetFormatError as e:
        assert "\n" not in str(e) and str(e).startswith("ds/manifest.json")
    else:  # what parses is a manifest whose every field has its declared type
        assert isinstance(manifest, Manifest)
        assert all(isinstance(s.num_cells, int) and s.num_cells >= 0 for s in manifest.shards)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_any_text_as_a_manifest_is_one_line(text):
    with pytest.raises(oj.DatasetFormatError) as caught:
        parse_manifest(text, "ds/manifest.json")
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def loader_and_state(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        loader = oj.make_loader(ds, batch_size=32, sampling=oj.Block(4, 4), seed=1, num_epochs=None)
        for _ in range(3):
            next(loader)
        yield loader, json.loads(json.dumps(loader.get_state()))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_loader_state_is_refused_by_the_loader(loader_and_state, data):
    loader, state = loader_and_state
    damaged = _mutated(data, state)
    try:
        loader.set_state(damaged)
    except oj.StateMismatchError as e:  # one line, or one line per differing config key
        lines = str(e).splitlines()
        assert len(lines) == 1 or all(line.startswith("  ") for line in lines[1:])
    loader.set_state(state)  # and the loader is whole again
    assert loader.get_state() == state


def test_a_damaged_state_file_is_one_line(tmp_path):
    (tmp_path / "process_0-of-1.json").write_text('{"version": 1, "con')
    with pytest.raises(
        oj.StateMismatchError, match=r"cannot read the loader state .*process_0-of-1.json"
    ) as caught:
        oj.read_loader_states(tmp_path)
    assert "\n" not in str(caught.value)
