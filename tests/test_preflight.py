"""The checks a search makes before data and Ray, each on real inputs: addresses against real
sockets, resources against this machine's counts, spaces parsed from YAML, manifests on disk."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from dptune.search import preflight
from dptune.search.preflight import PreflightError
from dptune.space import ResourcesSpec, load_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"


@pytest.fixture
def listening() -> Iterator[int]:
    """A TCP port with a listener on 127.0.0.1 (what a Ray head's GCS port looks like to a connect)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def test_address_syntax() -> None:
    assert preflight.check_address_syntax("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert preflight.check_address_syntax("ray://head.example:10001") == ("head.example", 10001)
    assert preflight.check_address_syntax("[::1]:6379") == ("::1", 6379)
    assert preflight.check_address_syntax(" head:1 ") == ("head", 1)
    assert preflight.check_address_syntax("auto") is None and preflight.check_address_syntax("local") is None
    for bad in ("head", "head:0", "head:65536", "http://head:6379", "head:63 79", ""):
        with pytest.raises(PreflightError, match="not a Ray address .expected HOST:PORT"):
            preflight.check_address_syntax(bad, "RAY_ADDRESS")


def test_an_address_answers_or_is_refused_in_bounded_time(listening: int) -> None:
    preflight.check_address(f"127.0.0.1:{listening}")
    preflight.check_address("auto")  # Ray's keyword: not checked here
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(PreflightError, match=rf"--address '127.0.0.1:{port}': no Ray cluster answers there"):
        preflight.check_address(f"127.0.0.1:{port}", timeout_s=2.0)


def test_the_join_error_says_what_token_to_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    assert not preflight.token_configured()
    error = preflight.cluster_join_error("10.0.0.1:6379", "RAY_ADDRESS", ConnectionError("Unauthenticated\nmore"))
    assert str(error).startswith(
        "RAY_ADDRESS '10.0.0.1:6379': could not join the Ray cluster (Unauthenticated); "
        "the cluster most likely requires token authentication"
    )
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert not preflight.token_configured()  # the mode without a token
    token = tmp_path / "token"
    token.write_text("secret")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert preflight.token_configured()
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    assert preflight.token_configured()
    error = preflight.cluster_join_error("10.0.0.1:6379", "--address", RuntimeError(""))
    assert "(RuntimeError); RAY_AUTH_MODE=token is set: check that the token" in str(error)


def test_resources_a_machine_cannot_give_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert preflight.local_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert preflight.local_gpus() == 0
    preflight.check_local_resources(ResourcesSpec(cpus=2, gpu=0.5), cpus=2, gpus=1)
    with pytest.raises(
        PreflightError,
        match=r"a trial asks for 4 CPU\(s\) and 0 GPU\(s\), more than this machine "
        r"has \(2 CPU\(s\), 0 GPU\(s\)\)",
    ):
        preflight.check_local_resources(ResourcesSpec(cpus=4), cpus=2, gpus=0)
    with pytest.raises(PreflightError, match="and 1 GPU"):
        preflight.check_local_resources(ResourcesSpec(gpu=1), cpus=16, gpus=0)
    # a cluster: one live node must fit a whole trial (as ray.nodes() lists them)
    nodes = [
        {"Alive": True, "Resources": {"CPU": 0.0}},
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]
    preflight.check_cluster_resources(ResourcesSpec(cpus=8, gpu=1), nodes)
    with pytest.raises(PreflightError, match=r"more than any node of the Ray cluster has \(8 CPU\(s\), 1 GPU\(s\)\)"):
        preflight.check_cluster_resources(ResourcesSpec(cpus=4, gpu=2), nodes)  # the 8-GPU node is dead


def test_settings_that_do_nothing_and_sizes_that_need_n_are_told() -> None:
    grid = load_space(TINY, {"sampler.trials_per_cell": 5, "coupling.rule": "none"}).space
    assert preflight.flag_warnings(grid, trials_per_cell_flag=True) == [
        "--trials-per-cell (or --set sampler.trials_per_cell) does not apply to sampler 'grid', which runs each grid "
        "point once; ignored",
        "coupling.reference_batch_size does not apply with coupling rule 'none'; ignored",
    ]
    assert preflight.flag_warnings(load_space(TINY).space, trials_per_cell_flag=False) == []
    space = load_space(TINY).space  # δ = 1e-5, B up to 256
    assert preflight.data_warnings(space, 100_000) == []  # δ = 1/N is not above it
    notes = preflight.data_warnings(space, 200)
    assert notes == ["batch_size: B = [256] exceed the training set (N = 200) and are dropped"]
    (delta,) = preflight.data_warnings(load_space(TINY, {"privacy.delta": 0.01}).space, 1000)
    assert delta.startswith("privacy.delta: delta=0.01 is larger than 1/num_examples = 1/1000")
    preflight.check_steps(space, 1000)
    with pytest.raises(ValueError, match=r"batch_size, epochs: B = 32 gives T = E·N/B = 1875000 steps"):
        preflight.check_steps(load_space(TINY, {"epochs": [3000]}).space, 20_000)


def test_a_manifest_is_written_whole_and_read_back(tmp_path: Path) -> None:
    loaded = load_space(TINY)
    assert preflight.read_manifest(str(tmp_path)) is None
    preflight.write_manifest(str(tmp_path), loaded, "tiny", "tiny-0")
    assert [p.name for p in tmp_path.iterdir()] == [preflight.MANIFEST]  # no temporary left
    assert preflight.read_manifest(str(tmp_path)) == {
        "search_id": "tiny-0",
        "name": "tiny",
        "spec_hash": loaded.spec_hash,
        "spec_yaml": loaded.text,
    }
    (tmp_path / preflight.MANIFEST).write_text(json.dumps(["not", "a", "manifest"]))
    with pytest.raises(PreflightError, match="unreadable manifest .'expected an object with spec_hash and spec_yaml'"):
        preflight.read_manifest(str(tmp_path))
    preflight.write_manifest(str(tmp_path), loaded, "tiny", "tiny-0")
    changed = load_space(TINY, {"min_steps": 5})
    with pytest.raises(PreflightError, match=r"--resume: the search space differs .* min_steps: 10 → 5"):
        preflight.check_same_space(str(tmp_path), changed)
    preflight.check_same_space(str(tmp_path), loaded)


def test_resume_opens_one_footer_per_compacted_file_and_quarantines_a_corrupt_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After compaction a resume's check opens a few footers, whatever the number of runs; a compacted file
    that cannot be read is refused, or moved aside with its runs (which are then unrecorded)."""
    import pyarrow.parquet as pq

    from dptune.records import ResultsStore, compact_records, read_table
    from test_records import make_result, write

    store = ResultsStore(str(tmp_path))
    for n in range(40):
        write(store, f"t{n:02d}", make_result())
    compact_records(str(tmp_path))
    opened: list[str] = []
    real_schema = pq.read_schema
    monkeypatch.setattr(pq, "read_schema", lambda path, **kw: opened.append(path) or real_schema(path, **kw))
    assert preflight.check_results_folder(str(tmp_path), quarantine=False) == [] and len(opened) == 4
    (compacted,) = (tmp_path / "trials").iterdir()
    compacted.write_bytes(compacted.read_bytes()[:-40])  # cut short
    with pytest.raises(PreflightError, match=f"{compacted}: not a readable Parquet file"):
        preflight.check_results_folder(str(tmp_path), quarantine=False)
    (note,) = preflight.check_results_folder(str(tmp_path), quarantine=True)
    assert "moved to" in note and (tmp_path / "quarantine" / "trials" / compacted.name).exists()
    assert read_table(str(tmp_path), "trials").empty and store.completed_trial_ids() == set()
