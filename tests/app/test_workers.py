"""The pieces that let a sweep's jobs and a search's workers run in several processes: the sweep state and float-test
cache updated from other processes without losing an entry, the sweep callbacks sent to a job without their lock,
the checks of a shared storage and of the launchers, and the uniform-first sampler drawing in turn across workers."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from omegaconf import OmegaConf

from quark_lightning.app.float_cache import float_test
from quark_lightning.app.rundir import (
    CLAIMED,
    FLOAT_TEST_CACHE,
    SWEEP_STATE,
    add_job,
    claim_sweep,
    finish,
    locked,
    run_dir_lock,
)
from quark_lightning.app.sampler import UniformFirstSampler
from quark_lightning.app.summary import SweepSummary
from quark_lightning.app.workers import (
    TAG_TRIAL,
    check_launcher_args,
    check_storage,
    sqlite_path,
    tag_trial,
)

pytestmark = pytest.mark.integration
FORK = multiprocessing.get_context("fork")


def _as_another_process() -> None:
    """A forked child is a job's process: it did not claim the sweep (the parent did) and holds no state lock."""
    CLAIMED.clear()


def _cache_entry(sweep: str, key: str) -> None:
    _as_another_process()

    def slow_test() -> dict[str, float]:  # long enough for every job to have read the cache before any writes
        time.sleep(0.5)
        return {"test_acc": float(len(key))}

    float_test(Path(sweep) / FLOAT_TEST_CACHE, key, slow_test)


def _job(sweep: str, name: str) -> None:
    _as_another_process()
    add_job(Path(sweep), Path(sweep) / name)


def _run_children(target: Any, sweep: Path, names: list[str]) -> None:
    children = [FORK.Process(target=target, args=(str(sweep), name)) for name in names]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0


@pytest.fixture
def sweep(tmp_path: Path) -> Any:
    """A sweep directory claimed and locked by this process, as the sweep's end callback does."""
    out = tmp_path / "sweep"
    out.mkdir()
    with run_dir_lock(out):
        claim_sweep(out, [FLOAT_TEST_CACHE, "summary.csv"])
        yield out
        CLAIMED.pop((out.resolve(), SWEEP_STATE), None)


def test_jobs_in_other_processes_lose_no_float_cache_entry(sweep: Path) -> None:
    keys = [f"model-{i}" for i in range(5)]
    _run_children(_cache_entry, sweep, keys)
    cache = json.loads((sweep / FLOAT_TEST_CACHE).read_text())
    assert cache == {k: {"test_acc": float(len(k))} for k in keys}
    finish(sweep, None, SWEEP_STATE)
    state = json.loads((sweep / SWEEP_STATE).read_text())
    assert [e["path"] for e in state["written"]] == [FLOAT_TEST_CACHE] and state["state"] == "complete"


def test_jobs_in_other_processes_are_listed_in_the_sweep_state(sweep: Path) -> None:
    add_job(sweep, sweep / "own")  # a job of this process (the basic launcher)
    _run_children(_job, sweep, [str(i) for i in range(6)])
    finish(sweep, None, SWEEP_STATE)  # the sweep's last write keeps what its jobs added
    state = json.loads((sweep / SWEEP_STATE).read_text())
    assert sorted(state["jobs"]) == ["0", "1", "2", "3", "4", "5", "own"]


def test_a_finished_sweep_lists_no_more_jobs(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    out.mkdir()
    with run_dir_lock(out):
        claim_sweep(out, [])
        finish(out, None, SWEEP_STATE)
    before = (out / SWEEP_STATE).read_bytes()
    add_job(out, out / "late")
    assert (out / SWEEP_STATE).read_bytes() == before


def _start_job(sent: bytes, job: str) -> None:
    _as_another_process()
    callback = pickle.loads(sent)  # what a parallel launcher does with the Hydra context
    callback.on_job_start(OmegaConf.create({"hydra": {"runtime": {"output_dir": job}}}))


def test_the_sweep_callback_goes_to_a_job_without_its_lock(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cfg = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"}, "overrides": {"task": []}}}
    )
    callback = SweepSummary()
    callback.on_multirun_start(cfg)
    try:
        child = FORK.Process(target=_start_job, args=(pickle.dumps(callback), str(sweep / "0")))
        child.start()
        child.join(60)
        assert child.exitcode == 0 and locked(sweep)  # the job listed itself; the sweep still holds its lock
    finally:
        callback.on_multirun_end(cfg)
    assert not locked(sweep)
    assert json.loads((sweep / SWEEP_STATE).read_text())["jobs"] == ["0"]


# ----------------------------------------------------------------------------------------------- checks
def _search_cfg(**sweeper: Any) -> Any:
    node = {
        "storage": None,
        "study_name": "s",
        "direction": ["maximize", "minimize"],
        "custom_search_space": TAG_TRIAL,
        "sampler": {"_target_": "quark_lightning.app.sampler.UniformFirstSampler"},
    }
    return OmegaConf.create({"hydra": {"sweeper": {**node, **sweeper}}})


def test_sqlite_urls() -> None:
    assert sqlite_path("sqlite:///runs/bits.db") == Path("runs/bits.db")
    assert sqlite_path("sqlite:////abs/bits.db?timeout=30") == Path("/abs/bits.db")
    assert sqlite_path("sqlite://") is None and sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("postgresql://host/db") is None


@pytest.mark.parametrize(
    ("sweeper", "message"),
    [
        ({"storage": "sqlite://"}, "is a database in memory: each worker would have a study of its own"),
        ({"storage": "sqlite:///{tmp}/missing/bits.db"}, "the folder {tmp}/missing does not exist"),
        ({"storage": "sqlite:///{tmp}/bits.db", "study_name": None}, "needs hydra.sweeper.study_name"),
        ({"storage": "sqlite:///{tmp}/bits.db", "custom_search_space": None}, f"needs {TAG_TRIAL}"),
    ],
)
def test_a_storage_that_cannot_be_shared_is_named(sweeper: dict[str, Any], message: str, tmp_path: Path) -> None:
    sweeper = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in sweeper.items()}
    with pytest.raises(ValueError, match="hydra.sweeper") as err:
        check_storage(_search_cfg(**sweeper))
    assert message.format(tmp=tmp_path) in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_a_shared_storage_gets_its_study_before_the_first_job(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bits.db'}"
    check_storage(_search_cfg(storage=url))
    study = optuna.load_study(study_name="s", storage=url)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"] and study.trials == []
    with pytest.raises(ValueError, match="the study cannot be created or loaded"):  # other directions: named
        check_storage(_search_cfg(storage=url, direction=["minimize", "minimize"]))


def test_a_launcher_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_launcher_args(["hydra/launcher=joblib", "hydra/launcher=submitit_local"]) is None  # installed
    monkeypatch.setattr("quark_lightning.app.workers.available", lambda module: False)
    assert check_launcher_args(["quant=none", "hydra/launcher=basic"]) is None
    message = check_launcher_args(["hydra/launcher=submitit_slurm"])
    assert message == (
        'hydra/launcher=submitit_slurm needs Hydra\'s hydra-submitit-launcher: pip install -e ".[search]"'
    )


# ----------------------------------------------------------------------------------------------- the sampler
class _SlowRandom(optuna.samplers.RandomSampler):
    """The same draw in every worker (one seed), slowly: without the sampling lock both workers would draw it."""

    def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
        time.sleep(0.3)
        return super().sample_independent(study, trial, name, distribution)


def _draw(url: str, folder: str, queue: Any) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = UniformFirstSampler(widths=[], base=_SlowRandom(seed=0), seed=0, storage=url)
    study = optuna.load_study(study_name="s", storage=url, sampler=sampler)
    trial = study.ask()
    values = (
        trial.suggest_categorical("++quant.layer_bits.a", [2, 4, 8]),
        trial.suggest_categorical("++quant.layer_bits.b", [2, 4, 8]),
    )
    tag_trial(OmegaConf.create({"hydra": {"sweep": {"dir": folder}}}), trial)  # releases the lock
    queue.put((trial.number, values))


def test_workers_draw_in_turn_and_never_the_same_configuration(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bits.db'}"
    study = optuna.create_study(study_name="s", storage=url, directions=["maximize", "minimize"])
    first = study.ask()  # one finished trial: the space the sampler draws its layer_bits from
    first.suggest_categorical("++quant.layer_bits.a", [2, 4, 8])
    first.suggest_categorical("++quant.layer_bits.b", [2, 4, 8])
    study.tell(first, [1.0, 1.0])
    queue = FORK.Queue()
    workers = [FORK.Process(target=_draw, args=(url, str(tmp_path / f"w{i}"), queue)) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    drawn = dict(queue.get(timeout=5) for _ in workers)
    assert sorted(drawn) == [1, 2, 3]  # each trial number once
    configs = [*drawn.values(), (first.params["++quant.layer_bits.a"], first.params["++quant.layer_bits.b"])]
    assert len(set(configs)) == 4, configs  # unlike each other's and the finished trial's
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert {t.number: t.params["++hparams_search.trial"] for t in trials[1:]} == {1: 1, 2: 2, 3: 3}
    assert {Path(t.user_attrs["sweep_dir"]).name for t in trials[1:]} == {"w0", "w1", "w2"}


def test_a_second_worker_on_one_sweep_dir_is_refused(tmp_path: Path) -> None:
    """Two workers of one study on one sweep directory: the second stops before its first trial, told what to do."""
    sweep = tmp_path / "w0"
    url = f"sqlite:///{tmp_path / 'bits.db'}"
    cfg = _search_cfg(storage=url)
    cfg.hydra.sweep = {"dir": str(sweep), "subdir": "${hydra.job.num}"}
    cfg.hydra.overrides = {"task": []}
    first = SweepSummary()
    first.on_multirun_start(cfg)  # the first worker holds the directory
    try:
        before = (sweep / SWEEP_STATE).read_bytes()
        with pytest.raises(SystemExit) as stop:
            SweepSummary().on_multirun_start(cfg)
        message = str(stop.value.code)
        assert message.startswith(f"error: the run directory {sweep} is in use by another run")
        assert f"Workers sharing hydra.sweeper.storage={url} each need a sweep directory of their own" in message
        assert (sweep / SWEEP_STATE).read_bytes() == before  # the first worker's state untouched
    finally:
        first.on_multirun_end(cfg)
