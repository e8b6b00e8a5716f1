"""Compiled (numba) sequential replay: the fast path of the replay driver, for policies with compiled hooks.

It implements exactly the rules of :class:`kvlab.cache.PrefixCache` on dense key ids (0..num_keys-1):
free blocks form a stack whose top is the free queue's front, each key a doubly linked list of the
blocks holding it (oldest first), and the eviction policy is a :class:`CompiledPolicy`: numba functions
over a policy-owned state tuple, called at the same events as the Python hooks. The tests check every
compiled policy hit for hit against the Python core running the same policy (its Python class, or the
same hooks through :class:`kvlab.policies._adapter.CompiledAdapter`). Counts are in blocks.

Orphans: a cached block is *orphaned* while its parent key (the previous block of its sequence) is not
cached; it is then unreachable. ``orphan_blocks`` is their number after each request and
``orphan_evictions`` the evictions of orphaned blocks.

Compilation is cached on disk per policy: numba caches a function by its defining file, and the kernel is
specialised on the policy's hooks, so :func:`kernel_for` writes a tiny module per set of hooks (named by a
digest of every source file and constant the machine code depends on) whose one function calls the
generic kernel with the hooks bound as globals, and lets numba cache that. The modules live in
``kernel_cache_dir()``; a process that finds one loads the compiled kernel instead of compiling it.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import inspect
import os
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import NamedTuple

import numba as nb
import numpy as np
from numba.core.dispatcher import Dispatcher


@nb.njit(cache=True)
def no_miss(state, key, seq, pos):
    """The default ``on_miss`` hook: ignore the keys about to be computed."""


@nb.njit(cache=True)
def no_insert(state, b, key, seq, pos):
    """An ``on_insert`` hook that does nothing (the Python adapter then skips the call)."""


@nb.njit(cache=True)
def no_hit(state, b, key, seq, pos):
    """An ``on_hit`` hook that does nothing (the Python adapter then skips the call)."""


class CompiledPolicy(NamedTuple):
    """numba-compiled hooks of one policy (block ids ``b``, dense key ids ``key``, ``seq`` = request index).

    ``init(capacity, num_keys, params) -> state`` (``capacity``: the cache's ``capacity_blocks``, in blocks;
    ``num_keys``: dense key ids); ``on_insert(state, b, key, seq, pos)``;
    ``on_hit(state, b, key, seq, pos)``; ``on_pin(state, b, seq)``; ``on_unpin(state, b, seq)``;
    ``victim(state) -> b`` (only called with at least one evictable block); ``on_evict(state, b)``;
    ``on_miss(state, key, seq, pos)`` (optional): once per missed full block of an admitted request, in
    order, after its hits are touched and before any block is allocated for it (the Python
    ``on_miss(keys, ctx)``). ``params`` is what the policy's ``compiled_params()`` returns: a float64
    array of its numeric parameters, or a tuple of arrays (e.g. parameters and per-request data).

    Used only when the Python core drives the hooks (:class:`kvlab.policies._adapter.CompiledAdapter`):
    ``on_remove(state, b)`` (optional, default ``on_evict``): a key dropped without eviction (``reset``);
    ``grow(state, num_keys) -> state`` (optional): the state for more dense key ids, every key id seen so
    far keeping its state (needed only when ``init``'s per-key arrays have columns besides the ``num_keys``
    key columns, e.g. list sentinels; otherwise the adapter grows them itself).
    """

    init: object
    on_insert: object
    on_hit: object
    on_pin: object
    on_unpin: object
    victim: object
    on_evict: object
    on_miss: object = no_miss
    on_remove: object = None
    grow: object = None

    @property
    def kernel_hooks(self) -> tuple:
        """The hooks the replay kernel calls, in its argument order."""
        return (self.init, self.on_insert, self.on_hit, self.on_pin, self.on_unpin, self.victim, self.on_evict,
                self.on_miss)


@nb.njit(cache=True, inline="always")
def max_hit_blocks(nfull: int, prompt_tokens: int, block_size: int, ideal: bool) -> int:
    """Hit cap in blocks: every full block (ideal) or ``(prompt_tokens - 1) // block_size`` (vllm)."""
    if ideal:
        return nfull
    return min(nfull, max(prompt_tokens - 1, 0) // block_size)


@nb.njit(nogil=True)
def replay_kernel(
    offsets: np.ndarray,  # int64 [n+1] into key_ids
    key_ids: np.ndarray,  # int64 dense key per full block
    truth_ids: np.ndarray,  # int64 per full block, or empty (no verify)
    prompt_tokens: np.ndarray,  # int64 [n]
    num_blocks: np.ndarray,  # int64 [n] = ceil(prompt_tokens / block_size)
    num_keys: int,
    capacity: int,  # blocks: the cache's capacity_blocks (its pool; block ids 0..capacity-1)
    block_size: int,
    ideal: bool,
    params,  # the policy's compiled_params(): float64 array or tuple of arrays
    init,
    on_insert,
    on_hit,
    on_pin,
    on_unpin,
    victim,
    on_evict,
    on_miss,
):
    n = len(prompt_tokens)
    verify = len(truth_ids) > 0
    hit_blocks = np.zeros(n, np.int64)
    new_blocks = np.zeros(n, np.int64)
    evictions = np.zeros(n, np.int64)
    orphan_evictions = np.zeros(n, np.int64)
    collisions = np.zeros(n, np.int64)
    admitted = np.zeros(n, np.bool_)
    cached_after = np.zeros(n, np.int64)
    orphans_after = np.zeros(n, np.int64)

    state = init(capacity, num_keys, params)
    free_stack = np.arange(capacity - 1, -1, -1).astype(np.int64)  # top = front of the free queue
    free_top = capacity
    n_evictable = 0
    ref = np.zeros(capacity, np.int64)
    bkey = np.full(capacity, -1, np.int64)
    bparent = np.full(capacity, -1, np.int64)
    btruth = np.full(capacity, -1, np.int64)
    key_head = np.full(num_keys, -1, np.int64)
    key_tail = np.full(num_keys, -1, np.int64)
    children = np.zeros(num_keys, np.int64)  # cached blocks whose parent is this key
    same_next = np.full(capacity, -1, np.int64)
    same_prev = np.full(capacity, -1, np.int64)
    n_cached = 0
    n_orphans = 0
    req_blocks = np.empty(0, np.int64)

    for r in range(n):
        start = offsets[r]
        nfull = offsets[r + 1] - start
        total = num_blocks[r]
        if total > req_blocks.shape[0]:
            req_blocks = np.empty(total, np.int64)
        # admission steps (kvlab.cache.admission): 1 lookup; 2 lower-tier lookup: none in this kernel (tiers:
        # kvlab.tiers); 3 fit; 4 pin; 5 on_miss; 6 allocate; 7 load: none; 8 key
        # 1 lookup: device hits from position 0 to the first miss, at most max_hit
        max_hit = max_hit_blocks(nfull, prompt_tokens[r], block_size, ideal)
        h = 0
        while h < max_hit:
            b = key_head[key_ids[start + h]]
            if b < 0:
                break
            if verify and btruth[b] != truth_ids[start + h]:
                collisions[r] = 1
                break
            req_blocks[h] = b
            h += 1
        # 3 fit: the new blocks within free + evictable minus the hits that are evictable now
        need = total - h
        evictable_hits = 0
        for i in range(h):
            if ref[req_blocks[i]] == 0:
                evictable_hits += 1
        if need > free_top + n_evictable - evictable_hits:  # not admitted: nothing changes, nothing counted
            collisions[r] = 0
            cached_after[r] = n_cached
            orphans_after[r] = n_orphans
            continue
        admitted[r] = True
        hit_blocks[r] = h
        new_blocks[r] = need
        # 4 pin: count the hit and pin
        for i in range(h):
            b = req_blocks[i]
            on_hit(state, b, bkey[b], r, i)
            if ref[b] == 0:
                on_pin(state, b, r)
                n_evictable -= 1
            ref[b] += 1
        # 5 on_miss: name the keys about to be computed; 6 allocate: free queue front first, then victims
        for pos in range(h, nfull):
            on_miss(state, key_ids[start + pos], r, pos)
        ev = 0
        for j in range(need):
            if free_top > 0:
                free_top -= 1
                b = free_stack[free_top]
            else:
                b = victim(state)
                on_evict(state, b)
                n_evictable -= 1
                k = bkey[b]
                p = bparent[b]
                if p >= 0:
                    children[p] -= 1
                    if key_head[p] < 0:
                        n_orphans -= 1
                        orphan_evictions[r] += 1
                prev_b, next_b = same_prev[b], same_next[b]
                if prev_b >= 0:
                    same_next[prev_b] = next_b
                else:
                    key_head[k] = next_b
                if next_b >= 0:
                    same_prev[next_b] = prev_b
                else:
                    key_tail[k] = prev_b
                if key_head[k] < 0:
                    n_orphans += children[k]
                bkey[b] = -1
                bparent[b] = -1
                n_cached -= 1
                ev += 1
            ref[b] = 1
            req_blocks[h + j] = b
        evictions[r] = ev
        # 8 key the new full blocks (after all allocations, as vLLM's cache_full_blocks does)
        for pos in range(h, nfull):
            b = req_blocks[pos]
            k = key_ids[start + pos]
            p = key_ids[start + pos - 1] if pos > 0 else -1
            if key_head[k] < 0:
                n_orphans -= children[k]
            if p >= 0:
                children[p] += 1
                if key_head[p] < 0:
                    n_orphans += 1
            bkey[b] = k
            bparent[b] = p
            if verify:
                btruth[b] = truth_ids[start + pos]
            t = key_tail[k]
            same_prev[b] = t
            same_next[b] = -1
            if t >= 0:
                same_next[t] = b
            else:
                key_head[k] = b
            key_tail[k] = b
            n_cached += 1
            on_insert(state, b, k, r, pos)
        # release tail first: keyed -> evictable (policy), unkeyed -> free queue front
        for i in range(total - 1, -1, -1):
            b = req_blocks[i]
            ref[b] -= 1
            if ref[b] == 0:
                if bkey[b] >= 0:
                    on_unpin(state, b, r)
                    n_evictable += 1
                else:
                    free_stack[free_top] = b
                    free_top += 1
        cached_after[r] = n_cached
        orphans_after[r] = n_orphans
    return (hit_blocks, new_blocks, evictions, orphan_evictions, collisions, admitted, cached_after,
            orphans_after)


@nb.njit(cache=True, nogil=True)
def ideal_hits_kernel(
    offsets: np.ndarray,
    key_ids: np.ndarray,
    prompt_tokens: np.ndarray,
    num_keys: int,
    block_size: int,
    ideal: bool,
) -> np.ndarray:
    """Hit blocks per request with unbounded capacity (every computed full block stays cached)."""
    n = len(prompt_tokens)
    seen = np.zeros(num_keys, np.bool_)
    hits = np.zeros(n, np.int64)
    for r in range(n):
        start = offsets[r]
        nfull = offsets[r + 1] - start
        max_hit = max_hit_blocks(nfull, prompt_tokens[r], block_size, ideal)
        h = 0
        while h < max_hit and seen[key_ids[start + h]]:
            h += 1
        hits[r] = h
        for i in range(nfull):
            seen[key_ids[start + i]] = True
    return hits


# ---------------------------------------------------------------------- one kernel per policy, cached on disk
HOOK_NAMES = ("init", "on_insert", "on_hit", "on_pin", "on_unpin", "victim", "on_evict", "on_miss")
_KERNEL_MODULE = '''"""Generated by kvlab.cache.compiled.kernel_for: replay_kernel for the hooks of {label}, bound as
globals so that numba caches it on disk. Do not edit: a change of any code it depends on gives a new file."""
import numba as nb
import numpy as np

from kvlab.cache.compiled import bound_hooks, {imports}

{hooks} = bound_hooks(__name__)


@nb.njit(nogil=True, cache=True)
{body}
'''


def _kernel_source() -> tuple[str, str]:
    """``replay_kernel``'s source as a cached function ``kernel`` without the hook parameters (read as
    globals instead), and the names it needs from this module."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(replay_kernel.py_func)))
    fn = tree.body[0]
    fn.decorator_list = []
    fn.name = "kernel"
    params = [a.arg for a in fn.args.args]
    assert tuple(params[-len(HOOK_NAMES):]) == HOOK_NAMES, params
    fn.args.args = fn.args.args[: -len(HOOK_NAMES)]
    glb = replay_kernel.py_func.__globals__
    names = sorted(n for n in _names(replay_kernel.py_func.__code__) if isinstance(glb.get(n), Dispatcher))
    return ast.unparse(fn), ", ".join(names)


_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.generic, np.dtype)
_LOCK = threading.RLock()
_KERNELS: dict[tuple, tuple] = {}  # hooks -> (dispatcher, extra arguments)
_BINDING: dict[str, tuple] = {}  # generated module name -> its hooks (read by bound_hooks while it loads)


def kernel_cache_dir() -> Path | None:
    """Where the generated kernel modules (and, beside them, numba's cache of each) live:
    ``$NUMBA_CACHE_DIR/kvlab_kernels`` if NUMBA_CACHE_DIR is set, else ``kvlab/cache/__pycache__/kernels`` (in
    the tree, as numba caches the hooks themselves; ignored by git) if writable, else
    ``$XDG_CACHE_HOME/kvlab/kernels`` (``~/.cache``). None (compile in memory) when
    ``KVLAB_KERNEL_CACHE=0`` or nothing is writable."""
    if os.environ.get("KVLAB_KERNEL_CACHE", "1") == "0":
        return None
    if os.environ.get("NUMBA_CACHE_DIR"):
        candidates = [Path(os.environ["NUMBA_CACHE_DIR"]) / "kvlab_kernels"]
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        candidates = [Path(__file__).resolve().parent / "__pycache__" / "kernels", Path(xdg) / "kvlab" / "kernels"]
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    return None


def bound_hooks(module: str) -> tuple:
    """The hooks a generated kernel module binds as its globals (called by that module as it loads)."""
    return _BINDING[module]


def _names(code: types.CodeType) -> list[str]:
    """Global and attribute names ``code`` uses (nested code objects included), first use first."""
    names: list[str] = []
    codes = [code]
    while codes:
        c = codes.pop()
        names += c.co_names
        codes += [x for x in c.co_consts if isinstance(x, types.CodeType)]
    return list(dict.fromkeys(names))


def _referenced(func: types.FunctionType) -> list:
    """The global values and closure cells ``func``'s code refers to."""
    glb = func.__globals__
    return [glb[n] for n in _names(func.__code__) if n in glb] + [c.cell_contents for c in func.__closure__ or ()]


def _fold(h: hashlib._Hash, value: object, todo: list, files: set) -> None:
    """Fold a value jitted code reads (a global or closure cell) into the digest ``h``: a dispatcher is
    walked later (``todo``), constants by value (numba freezes them into the machine code), a kvlab module
    by its file and its dispatchers (code may call ``module.f``), a class or function by its source file."""
    if isinstance(value, Dispatcher):
        todo.append(value)
    elif isinstance(value, _PLAIN):
        h.update(repr(value).encode())
    elif isinstance(value, tuple | list):
        h.update(b"(")
        for v in value:
            _fold(h, v, todo, files)
        h.update(b")")
    elif isinstance(value, np.ndarray):
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] == "kvlab" and getattr(value, "__file__", None):
            files.add(value.__file__)
            todo += [v for v in vars(value).values() if isinstance(v, Dispatcher)]
    elif isinstance(value, type | types.FunctionType):
        with contextlib.suppress(TypeError):  # TypeError: a builtin
            files.add(inspect.getsourcefile(value) or "")
    else:
        text = repr(value)
        if " at 0x" not in text:  # not an address: the same in every process
            h.update(text.encode())


def _digest(roots: tuple) -> str | None:
    """A digest of everything the machine code of ``roots`` (numba dispatchers) depends on: the source
    files of every jitted function they reach (through globals, closures and kvlab modules), those
    functions' names, and the constants they read. None when some reached function has no source file
    (defined interactively) or is not a numba dispatcher: then nothing is cached on disk."""
    h = hashlib.sha256(f"{nb.__version__} {sys.version}".encode())
    files: set[str] = set()
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        func = getattr(obj, "py_func", None)
        if not isinstance(obj, Dispatcher) or not isinstance(func, types.FunctionType):
            return None
        try:
            path = inspect.getsourcefile(func)
        except TypeError:
            return None
        if path is None or not os.path.isfile(path):
            return None
        files.add(path)
        h.update(f"{func.__module__}:{func.__qualname__};".encode())
        for value in _referenced(func):
            _fold(h, value, todo, files)
    for path in sorted(f for f in files if os.path.isfile(f)):
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:20]


def _write_once(path: Path, text: str) -> None:
    """Create ``path`` with ``text`` unless it exists (atomic; concurrent writers leave one file)."""
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # fails if another process created it meanwhile: its file is the same
    except FileExistsError:
        pass
    except OSError:  # no hard links here: an atomic replace (same content)
        os.replace(tmp, path)
        return
    tmp.unlink()


def _load_kernel(hooks: tuple) -> Dispatcher | None:
    """The generated module's kernel for ``hooks``, or None when it cannot be cached."""
    digest = _digest((replay_kernel, *hooks))
    folder = kernel_cache_dir()
    if digest is None or folder is None:
        return None
    label = "".join(c if c.isalnum() else "_" for c in f"{hooks[5].py_func.__module__}_{hooks[5].__name__}")
    name = f"kvlab_kernel_{label}_{digest}"
    path = folder / f"{name}.py"
    try:
        body, imports = _kernel_source()
        _write_once(path, _KERNEL_MODULE.format(label=label, imports=imports, hooks=", ".join(HOOK_NAMES), body=body))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        _BINDING[name] = hooks
        spec.loader.exec_module(module)
    except OSError:
        return None
    sys.modules[name] = module
    return module.kernel


def kernel_for(policy: CompiledPolicy) -> tuple:
    """``(dispatcher, extra)``: ``dispatcher(*args, *extra)`` runs the replay kernel with ``policy``'s hooks
    (``args`` as :func:`_kernel_args` makes them). The dispatcher is the hooks' generated, disk-cached
    kernel (``replay_kernel``'s code with the hooks bound as globals), or ``replay_kernel`` itself with the
    hooks as ``extra`` when they cannot be cached."""
    hooks = policy.kernel_hooks
    with _LOCK:
        got = _KERNELS.get(hooks)
        if got is None:
            kernel = _load_kernel(hooks)
            got = _KERNELS[hooks] = (kernel, ()) if kernel is not None else (replay_kernel, hooks)
    return got


def _kernel_args(enc, capacity: int, ideal: bool, params) -> tuple:
    truth = enc.truth_ids if enc.truth_ids is not None else np.zeros(0, np.int64)
    if not isinstance(params, tuple):
        params = np.asarray(params, dtype=np.float64)
    return (enc.offsets, enc.key_ids, truth, enc.prompt_tokens, enc.num_blocks, enc.num_keys, capacity,
            enc.block_size, ideal, params)


def warm_up(policy: CompiledPolicy, enc, capacity: int, ideal: bool, params) -> float:
    """Compile the replay kernel of ``policy`` for these arguments' types, or load it from the disk cache,
    without running it; returns seconds (0 when that specialisation is already in this process). Called
    before a timed replay so that ``replay_seconds`` excludes JIT compilation. ``capacity`` in blocks."""
    kernel, extra = kernel_for(policy)
    sig = tuple(nb.typeof(a) for a in (*_kernel_args(enc, capacity, ideal, params), *extra))
    if sig in kernel.overloads:
        return 0.0
    t0 = time.perf_counter()
    kernel.compile(sig)
    return time.perf_counter() - t0


def run_compiled(policy: CompiledPolicy, enc, capacity: int, ideal: bool, params) -> dict[str, np.ndarray]:
    """Run the replay kernel of ``policy`` on an EncodedWorkload over a cache of ``capacity`` blocks; returns the
    per-request columns by name."""
    kernel, extra = kernel_for(policy)
    out = kernel(*_kernel_args(enc, capacity, ideal, params), *extra)
    names = ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "collisions", "admitted",
             "cached_blocks", "orphan_blocks")
    return dict(zip(names, out, strict=True))
