"""The replay kernel is compiled once per policy and cached on disk: a fresh process loads it (also when two
cold processes compiled it at once), the cache lives where NUMBA_CACHE_DIR says, and its name follows
every source file and constant the machine code depends on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba as nb

from kvlab.cache.compiled import CompiledPolicy, _digest, kernel_cache_dir, kernel_for, replay_kernel

SCRIPT = """
import json
from kvlab.cache.compiled import kernel_for
from kvlab.policies import make_policy
from kvlab.replay import replay
from kvlab.workload.workload import from_lists

w = from_lists([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7], [1, 2, 3, 4, 5, 6]])
r = replay(w, capacity_blocks=4, block_size=2, policy="lru", engine="compiled")
kernel, extra = kernel_for(make_policy("lru").compiled)
st = kernel.stats
print(json.dumps({"hits": r.requests["hit_blocks"].tolist(), "extra": len(extra),
                  "file": kernel.py_func.__code__.co_filename,
                  "loaded": sum(st.cache_hits.values()), "compiled": sum(st.cache_misses.values())}))
"""


def _start(cache: Path) -> subprocess.Popen:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    env.pop("KVLAB_KERNEL_CACHE", None)
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_two_cold_processes_compile_then_a_third_loads_from_disk(tmp_path):
    cold = [_result(p) for p in [_start(tmp_path), _start(tmp_path)]]  # at the same time, one cache folder
    warm = _result(_start(tmp_path))
    assert all(r["compiled"] == 1 and r["loaded"] == 0 for r in cold), cold
    assert warm["compiled"] == 0 and warm["loaded"] == 1, warm
    assert cold[0]["hits"] == cold[1]["hits"] == warm["hits"] == [0, 1, 0, 1]
    assert cold[0]["extra"] == warm["extra"] == 0  # the generated kernel, not the generic one
    kernels = sorted((tmp_path / "kvlab_kernels").glob("kvlab_kernel_*.py"))
    assert [str(k) for k in kernels] == [warm["file"]]  # one module, no temporary file left over
    assert not list((tmp_path / "kvlab_kernels").glob(".*"))


def test_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert kernel_cache_dir() == tmp_path / "kvlab_kernels"
    monkeypatch.setenv("KVLAB_KERNEL_CACHE", "0")
    assert kernel_cache_dir() is None


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


HELPER = """
import numba as nb
STEP = {step}

@nb.njit
def bump(state, b):
    state[0][b] += STEP
"""
HOOKS = """
import numba as nb
import numpy as np
from {helper} import bump

@nb.njit
def init(capacity, num_keys, params):
    return (np.zeros(capacity, np.int64),)

@nb.njit
def on_unpin(state, b, seq):
    bump(state, b)
"""


def _hooks(tmp_path: Path, tag: str, step: int) -> tuple:
    (tmp_path / f"helper_{tag}.py").write_text(HELPER.format(step=step))
    _load(tmp_path / f"helper_{tag}.py", f"helper_{tag}")
    (tmp_path / f"hooks_{tag}.py").write_text(HOOKS.format(helper=f"helper_{tag}"))
    return _load(tmp_path / f"hooks_{tag}.py", f"hooks_{tag}")


def test_kernel_name_follows_the_code_it_depends_on(tmp_path):
    a, b = _hooks(tmp_path, "a", 1), _hooks(tmp_path, "b", 1)
    digest = lambda m: _digest((replay_kernel, m.init, m.on_unpin))  # noqa: E731
    (tmp_path / "helper_c.py").write_text("")
    c = _hooks(tmp_path, "c", 2)  # a constant in a helper module differs
    assert digest(a) is not None and digest(a) == digest(a)
    assert digest(a) != digest(c)
    assert digest(a) != digest(b)  # same code, other functions: each has its own kernel
    assert _digest((replay_kernel, a.init, lambda s: 0)) is None  # not a numba function


def test_hooks_without_a_source_file_compile_in_memory():
    ns: dict = {}
    exec(textwrap.dedent("""
        import numba as nb
        import numpy as np
        @nb.njit
        def init(capacity, num_keys, params):
            return (np.zeros(capacity + 1, np.int64),)
        @nb.njit
        def nothing(state, b, seq):
            pass
    """), ns)
    init, nothing = ns["init"], ns["nothing"]
    policy = CompiledPolicy(init, nb.njit(lambda s, b, k, q, p: None), nb.njit(lambda s, b, k, q, p: None), nothing,
                            nothing, nb.njit(lambda s: 0), nb.njit(lambda s, b: None))
    kernel, extra = kernel_for(policy)
    assert kernel is replay_kernel and extra == policy.kernel_hooks


WRAPPERS = """
import sys
from kvlab.replay import replay
from kvlab.workload.workload import from_lists

w = from_lists([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7], [1, 2, 3, 4, 5, 6], [1, 2, 8, 8]])
for policy in sys.argv[1:]:
    print(policy, replay(w, capacity_blocks=3, block_size=2, policy=policy).requests["hit_blocks"].tolist())
"""


def test_two_wrapper_kernels_cached_by_different_processes_load_in_one(tmp_path):
    """prefix-aware (inner lru) and prefix-aware-lfu wrap their inner hooks in closures of one function:
    compiled in two processes, they must not export the same symbol (a process loading both from the disk
    cache crashed, exit -11)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("KVLAB_KERNEL_CACHE", None)

    def run(*policies: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", WRAPPERS, *policies], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, (policies, proc.returncode, proc.stderr[-2000:])
        return proc.stdout.splitlines()

    run("lru", "lfu")  # the inner hooks cached first, as in a test session
    alone = run("prefix-aware") + run("prefix-aware-lfu")
    assert run("prefix-aware", "prefix-aware-lfu") == alone
