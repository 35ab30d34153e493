"""Shared fixtures (helpers are in tests/tiny.py), and the mask command's report: an import error's own lines, then
one line per kind of failure, leaks first (python -m pytest -m mask; add --tb=short for tracebacks)."""

import atexit
import linecache
import os
import re
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # MKL's mode as train.py and sample.py set it (runtime.py)
import torch  # noqa: E402

# Tests are about exactness, not speed: one thread keeps float results reproducible and leaves the other
# core to the subprocesses some tests start.
torch.set_num_threads(1)
# remembered measurements and compile markers (training/runtime.py) go to a folder of this session, never the user's
os.environ["XDG_CACHE_HOME"] = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpt-char-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)  # nothing left in /tmp
ROOT = Path(__file__).resolve().parent.parent
KINDS = ("LEAK", "query", "no leak")  # the report's order: leaks, queries blind to their own key, other rules


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Forget what torch.compile traced once a test ends (its caches are per process)."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """A run finished through train.main (so with summary.json) at step 4 = max_iters, saved every 2 steps."""
    import train
    from tiny import cli_args, tiny_config

    cfg = tiny_config(tmp_path_factory.mktemp("finished"), max_iters=4, eval_interval=2, always_save_checkpoint=True,
                      tensorboard=False, exact_val=False)
    assert train.main(cli_args(cfg)) == 0
    return cfg


@pytest.fixture
def run_dir(finished, tmp_path):
    """A private copy of the finished run (tmp_path/out), and the config that resumes it to step 6."""
    shutil.copytree(finished.out_dir, tmp_path / "out")
    return finished.replace(out_dir=str(tmp_path / "out"), resume=True, max_iters=6), tmp_path / "out"


def pytest_addoption(parser):
    parser.addoption("--ckpt", default=None, help="--ckpt=PATH: also check this trained checkpoint (causality.py)")


_failures: list[tuple[str, str]] | None = None  # (test, first line) in a mask run
_unimportable: dict[str, list[str]] = {}  # in a mask run: an import error's lines -> the test files it stopped


def pytest_configure(config):
    global _failures
    explicit_tb = any(a.startswith("--tb") for a in config.invocation_params.args)
    if (config.getoption("markexpr") or "").strip() == "mask" and not explicit_tb:  # not "not mask"
        config.option.tbstyle, config.option.reportchars = "no", ""  # the summary below replaces both
        _failures = []


def pytest_ignore_collect(collection_path, config):
    """A mask run does not import the files that hold no mask test (seconds of start-up)."""
    if _failures is not None and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return "mark.mask" not in collection_path.read_text(encoding="utf-8") or None
    return None


def pytest_runtest_logreport(report):
    if report.failed and _failures is not None:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = (crash.message if crash else str(report.longrepr)).strip() or "failed"
        line = text.splitlines()[0].removeprefix("Failed: ").removeprefix("AssertionError: ").removeprefix("FAIL ")
        if crash and Path(crash.path).is_relative_to(ROOT) and not Path(crash.path).is_relative_to(ROOT / "tests"):
            line += f" ({Path(crash.path).relative_to(ROOT)}:{crash.lineno})"  # the code raised: where
        elif line == "Regex pattern did not match.":  # an error's text changed: say both texts
            line = "the error says {1}, where the test expects {0}".format(*(x.partition(": ")[2] for x in
                                                                             text.splitlines()[1:3]))
        elif crash and line in ("assert False", "assert not True"):  # a bare assert says nothing: its statement does
            where = f"{Path(crash.path).name}:{crash.lineno}"
            line = f"{linecache.getline(crash.path, crash.lineno).strip()} failed ({where})"
        _failures.append((report.nodeid.split("::")[-1], line))


def pytest_collectreport(report):
    if report.failed and _failures is not None:  # an edit that does not import (a typo): its error's own lines
        error = textwrap.dedent("\n".join(line[1:] for line in str(report.longrepr).splitlines() if line[:2] == "E "))
        _unimportable.setdefault(error or str(report.longrepr), []).append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    """Import errors, then failures grouped by what they say (a check's line is "FAIL name — what | figures"),
    leaks first."""
    for error, files in _unimportable.items():
        terminalreporter.write_sep("=", f"the code does not import ({len(files)} test files stopped): nothing ran")
        terminalreporter.write_line(f"{error}\n  [importing {', '.join(files)}]")
    if not _failures:
        return
    groups: dict[str, list[tuple[str, str]]] = {}  # a leak's pair stays apart; other numbers do not
    for test, line in _failures:
        name, _, what = line.rpartition(" — ") if " — " in line else (test, "", line)
        what = what.split(" | ")[0]
        key = what if what.startswith(KINDS) else re.sub(r"[-+]?\d[\d.e+-]*", "#", what)
        groups.setdefault(key, []).append((what, name))
    order = sorted(groups, key=lambda key: next((i for i, k in enumerate(KINDS) if key.startswith(k)), len(KINDS)))
    shown = 20
    terminalreporter.write_sep("=", f"{len(_failures)} failed (python -m pytest -m mask --tb=short for tracebacks)")
    for key in order[:shown]:
        (what, name), more = groups[key][0], len(groups[key]) - 1
        terminalreporter.write_line(f"{what}  [{name}{f' and {more} more' if more else ''}]")  # whole: it says where
    if len(order) > shown:
        terminalreporter.write_line(f"... and {len(order) - shown} more kinds of failure")
