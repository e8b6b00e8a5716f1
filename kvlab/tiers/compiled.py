"""Compiled (numba) tiered replay: the device cache and its lower tiers (kvlab.tiers.TierStack) in one kernel.

The kernel (:mod:`kvlab.tiers._kernel`) mirrors :class:`~kvlab.tiers.TierStack` step for step on dense ids, each
tier with its own policy's :class:`~kvlab.cache.compiled.CompiledPolicy` hooks on its own slot ids; the tests
check every per-request column and every tier counter against the Python core. Like
:func:`kvlab.cache.compiled.kernel_for`, :func:`tier_kernel_for` writes a small module per set of hooks (the
device's and each tier's), holding the kernel's code with the hooks bound as globals, so numba caches the
specialised kernel on disk (``kernel_cache_dir()``); one kernel serves every tier configuration (sizes, write
policy, inclusion, chunks, touch, max_load_tokens) of those policies. kvlab.cache.compiled's single-tier kernel
is not involved: replays without tiers run exactly as before.

Speed: the template's helpers only index arrays (they never allocate), so they are compiled without numba's
reference counting (``_nrt=False``): with it, every call's array arguments cost atomic increments and
decrements, about 70 % of the run time. The per-tier dispatchers ``t_*`` set ``_nrt=True`` explicitly: numba
passes a caller's NRT flag on to callees that set none, and a policy whose state is a StructRef needs NRT.
The policies' states are separate arguments, not one tuple, for the same reason (``_States``).

Units: blocks of the device's block size; a lower tier's slots hold one chunk each (``chunk_blocks`` blocks).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path

import numba as nb
import numpy as np
from numba.core.dispatcher import Dispatcher

from kvlab.cache.compiled import (  # its kernel cache's machinery, shared
    _BINDING,
    _LOCK,
    HOOK_NAMES,
    CompiledPolicy,
    _digest,
    _write_once,
    kernel_cache_dir,
    max_hit_blocks,
)
from kvlab.cache.prefix_cache import pool_blocks
from kvlab.tiers import _kernel
from kvlab.tiers.spec import Tier, check_tiers
from kvlab.tiers.stack import TierCounters

#: a lower tier's hooks, in the generated module's order (``on_remove``: the policy's, else ``on_evict``)
TIER_HOOKS = ("init", "on_insert", "on_hit", "on_pin", "on_unpin", "victim", "on_evict", "on_remove")
#: the dispatchers ``t_<hook>(S, lv, ...)``: their arguments after the state
_DISPATCH = {"on_insert": "b, key, seq, pos", "on_hit": "b, key, seq, pos", "on_pin": "b, seq",
             "on_unpin": "b, seq", "victim": "", "on_evict": "b", "on_remove": "b"}
#: template functions copied into the generated module, callees first
_TEMPLATE = ("tier_touch_one", "tier_release", "resident_above", "unpin_above", "pin_above", "tier_remove", "store",
             "stored", "device_dropped", "tiers_keyed", "tier_touch", "kernel")
_KERNELS: dict[tuple, Dispatcher] = {}  # hooks -> dispatcher
_WRITE = {"write_through": _kernel.WRITE_THROUGH, "write_through_selective": _kernel.SELECTIVE,
          "write_back": _kernel.WRITE_BACK}
_INCLUSION = {"none": _kernel.NO_INCLUSION, "inclusive": _kernel.INCLUSIVE, "exclusive": _kernel.EXCLUSIVE}


def tier_hooks(policy: CompiledPolicy) -> tuple:
    """A lower tier's hooks in :data:`TIER_HOOKS` order (a tier never calls ``on_miss``: TierStack does not)."""
    return (policy.init, policy.on_insert, policy.on_hit, policy.on_pin, policy.on_unpin, policy.victim,
            policy.on_evict, policy.on_remove if policy.on_remove is not None else policy.on_evict)


def _hook_names(levels: int) -> list[str]:
    return [f"h0_{h}" for h in HOOK_NAMES] + [f"h{lv}_{h}" for lv in range(1, levels + 1) for h in TIER_HOOKS]


class _States(ast.NodeTransformer):
    """Spell the template's policy states ``S`` as separate variables ``s0 .. sL`` (a tuple argument would cost
    reference counting at every call): a parameter or call argument ``S`` becomes ``s1, ..., sL``, ``S = ...``
    unpacks into ``s0, ..., sL`` and ``S[0]`` is ``s0``."""

    def __init__(self, levels: int) -> None:
        self.names = [f"s{lv}" for lv in range(levels + 1)]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:  # noqa: N802 - ast's visitor name
        args = []
        for a in node.args.args:
            args += [ast.arg(n) for n in self.names[1:]] if a.arg == "S" else [a]
        node.args.args = args
        node.decorator_list = []
        self.generic_visit(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.Call:  # noqa: N802
        self.generic_visit(node)
        args = []
        for a in node.args:
            is_s = isinstance(a, ast.Name) and a.id == "S"
            args += [ast.Name(n, ast.Load()) for n in self.names[1:]] if is_s else [a]
        node.args = args
        return node

    def visit_Assign(self, node: ast.Assign) -> ast.Assign:  # noqa: N802
        self.generic_visit(node)
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "S":
            node.targets = [ast.Tuple([ast.Name(n, ast.Store()) for n in self.names], ast.Store())]
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:  # noqa: N802
        if isinstance(node.value, ast.Name) and node.value.id == "S" and isinstance(node.slice, ast.Constant):
            return ast.Name(self.names[node.slice.value], ast.Load())
        return self.generic_visit(node)


def module_source(levels: int, cache: bool) -> str:
    """The generated module for ``levels`` lower tiers: the hooks bound as globals (``bound_hooks``), the
    per-tier dispatchers, and the template's functions, jitted (numba's disk cache when ``cache``)."""
    deco = f"@nb.njit(nogil=True, cache={cache})"
    bare = f"@nb.njit(nogil=True, cache={cache}, _nrt=False)"  # no reference counting (module docstring)
    states = ", ".join(f"s{lv}" for lv in range(1, levels + 1))
    out = [f'"""Generated by kvlab.tiers.compiled for {levels} lower tier(s): the tiered replay kernel with the',
           'hooks bound as globals, so that numba caches it on disk. Do not edit: new code gives a new file."""',
           "import numba as nb", "import numpy as np", "",
           "from kvlab.cache.compiled import bound_hooks, max_hit_blocks", "", "Arr = np.ndarray",
           f"({', '.join(_hook_names(levels))},) = bound_hooks(__name__)"]
    out += [f"{name} = {getattr(_kernel, name)}" for name in _kernel.CONSTANTS]
    calls = ", ".join(f"h{lv}_init(tcap[{lv}], num_keys, params[{lv}])" for lv in range(1, levels + 1))
    out += ["", "", deco, "def init_states(capacity, tcap, num_keys, params):",
            f"    return (h0_init(capacity, num_keys, params[0]), {calls})"]
    for hook, args in _DISPATCH.items():
        sep = ", " if args else ""
        out += ["", "", deco[:-1] + ", _nrt=True)", f"def t_{hook}({states}, lv{sep}{args}):"]
        for lv in range(1, levels + 1):
            call = f"h{lv}_{hook}(s{lv}{sep}{args})"
            if lv < levels:
                out.append(f"    {'if' if lv == 1 else 'elif'} lv == {lv}:")
                out.append(f"        return {call}" if hook == "victim" else f"        {call}")
            elif hook == "victim":
                out.append(f"    return {call}")
            elif levels == 1:
                out.append(f"    {call}")
            else:
                out += ["    else:", f"        {call}"]
    rewrite = _States(levels)
    for name in _TEMPLATE:
        tree = rewrite.visit(ast.parse(inspect.getsource(getattr(_kernel, name))))
        out += ["", "", deco if name == "kernel" else bare, ast.unparse(ast.fix_missing_locations(tree))]
    return "\n".join(out) + "\n"


def _load(hooks: tuple, levels: int) -> Dispatcher:
    """The generated module's kernel for ``hooks``: from a file in ``kernel_cache_dir()`` (numba caches it on
    disk), or compiled in memory when the hooks cannot be cached (defined interactively) or nothing is writable."""
    digest = _digest((max_hit_blocks, *hooks))
    folder = kernel_cache_dir()
    cache = digest is not None and folder is not None
    text = module_source(levels, cache)
    h = hashlib.sha256(f"{digest}\n{text}".encode() + Path(_kernel.__file__).read_bytes()).hexdigest()[:20]
    victim = HOOK_NAMES.index("victim")
    starts = [0] + [len(HOOK_NAMES) + len(TIER_HOOKS) * i for i in range(levels)]
    victims = "_".join(hooks[k + victim].__name__ for k in starts)
    label = "".join(c if c.isalnum() else "_" for c in f"{levels}_{victims}")[:80]
    name = f"kvlab_tiers_kernel_{label}_{h}"
    _BINDING[name] = hooks
    if cache:
        path = folder / f"{name}.py"
        try:
            _write_once(path, text)
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            return module.kernel
        except OSError:
            text = module_source(levels, False)
    module = types.ModuleType(name)
    exec(compile(text, f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - our own generated code
    return module.kernel


def tier_kernel_for(device: CompiledPolicy, tiers: Sequence[CompiledPolicy]) -> Dispatcher:
    """The tiered replay kernel for a device policy and one policy per lower tier (cached per hook set)."""
    hooks = tuple(device.kernel_hooks) + tuple(h for t in tiers for h in tier_hooks(t))
    with _LOCK:
        kernel = _KERNELS.get(hooks)
        if kernel is None:
            kernel = _KERNELS[hooks] = _load(hooks, len(tiers))
    return kernel


def tier_slots(tiers: Sequence[Tier], demand_blocks: int) -> list[int]:
    """Slots (chunks) of each lower tier, as TierStack sizes them (``demand_blocks``: its bound on the blocks
    the workload stores; kvlab.cache.pool_blocks)."""
    return [pool_blocks(t.chunk_slots, demand_blocks // t.chunk_blocks + 1) for t in tiers]


def tier_arrays(tiers: Sequence[Tier], slots: Sequence[int], num_keys: int) -> tuple:
    """The kernel's fresh tier state ``(C, SL, KS, P)`` (kvlab.tiers._kernel) for ``tiers`` of ``slots``
    chunks each, over ``num_keys`` dense keys."""
    levels = len(tiers)
    C = np.zeros((levels + 1, _kernel.NCOLS), np.int64)
    C[1:, _kernel.CAP] = slots
    C[1:, _kernel.BASE] = np.cumsum([0, *slots])[:-1]
    C[1:, _kernel.TOP] = slots
    for lv, t in enumerate(tiers, 1):
        C[lv, [_kernel.CHUNK, _kernel.WRITE, _kernel.SEL, _kernel.INCL, _kernel.TOUCH]] = (
            t.chunk_blocks, _WRITE[t.write], t.selective_hits, _INCLUSION[t.inclusion], t.touch)
    SL = np.zeros((6, sum(slots)), np.int64)
    for lv, cap in enumerate(slots, 1):
        SL[_kernel.FREE, C[lv, _kernel.BASE]: C[lv, _kernel.BASE] + cap] = np.arange(cap - 1, -1, -1)  # top: slot 0
    SL[[_kernel.SKEY, _kernel.SPOS, _kernel.MARK]] = -1
    KS = np.full((2 * levels + 2, num_keys), -1, np.int64)
    KS[levels + 1:] = 0
    return C, SL, KS, np.zeros((levels + 1, 5), np.int64)


def _as_params(params: object) -> object:
    return params if isinstance(params, tuple) else np.asarray(params, dtype=np.float64)


class TieredReplay:
    """One compiled tiered replay: the device policy (prepared, its ``compiled_params()`` in ``params``), the
    lower tiers, an EncodedWorkload ``enc``, the device pool (``capacity``, blocks) and ``max_load_tokens``.
    The tier policies are made from their specs and prepared with ``enc`` here."""

    def __init__(self, device: CompiledPolicy, params: object, tiers: Sequence[Tier], enc: object, capacity: int,
                 ideal: bool, max_load_tokens: int | None) -> None:
        from kvlab.policies import make_policy

        check_tiers(tiers, max_load_tokens=max_load_tokens)  # the rules TierStack applies, on this backend too
        policies = []
        self.tier_params = []
        for t in tiers:
            pol = make_policy(t.policy, **t.policy_params)
            # the Python tier's policy sees a cache of chunk_blocks * block_size tokens per slot
            pol.prepare(dataclasses.replace(enc, block_size=enc.block_size * t.chunk_blocks))
            policies.append(pol.compiled)
            self.tier_params.append(_as_params(pol.compiled_params()))
        self.tiers = list(tiers)
        self.kernel = tier_kernel_for(device, policies)
        self.params = (_as_params(params), *self.tier_params)
        self.enc, self.capacity, self.ideal = enc, capacity, ideal
        self.max_load = -1 if max_load_tokens is None else max_load_tokens // enc.block_size
        self.slots = tier_slots(tiers, int(enc.num_blocks.sum()))

    def _args(self) -> tuple:
        enc = self.enc
        truth = enc.truth_ids if enc.truth_ids is not None else np.zeros(0, np.int64)
        return (enc.offsets, enc.key_ids, truth, enc.prompt_tokens, enc.num_blocks, enc.num_keys, self.capacity,
                enc.block_size, self.ideal, self.max_load, self.params,
                *tier_arrays(self.tiers, self.slots, enc.num_keys))

    def warm_up(self) -> float:
        """Compile the kernel for these arguments' types, or load it from the disk cache, without running it;
        returns seconds (0 when this process already has it)."""
        sig = tuple(nb.typeof(a) for a in self._args())
        if sig in self.kernel.overloads:
            return 0.0
        t0 = time.perf_counter()
        self.kernel.compile(sig)
        return time.perf_counter() - t0

    def run(self) -> dict:
        """The per-request columns by name (those of kvlab.cache.compiled.run_compiled, plus ``tier_hit_blocks``:
        [n, tiers] blocks loaded per lower tier) and ``_counters``: one TierCounters per lower tier."""
        args = self._args()
        out = self.kernel(*args)
        names = ("hit_blocks", "new_blocks", "evictions", "orphan_evictions", "collisions", "admitted",
                 "cached_blocks", "orphan_blocks", "tier_hit_blocks")
        cols = dict(zip(names, out, strict=True))
        C = args[-4]
        cols["_counters"] = [
            TierCounters(**{f: int(C[lv, _kernel.LOOKED_UP + i]) for i, f in enumerate(_kernel.COUNTERS)})
            for lv in range(1, len(self.tiers) + 1)]
        return cols


def tier_policy_compiled(tier: Tier) -> bool:
    """Whether the tiered kernel runs ``tier``'s policy: it has compiled hooks that do not read the trace's
    blocks by request and position. A twin whose ``compiled_params()`` carry an array with one entry per full
    block of the workload (belady's future uses; the prefix-tree policies' parent keys: pgdsf, sglang-leaf,
    prefix-aware*) finds a block's data from its hooks' ``(seq, pos)``; in a lower tier these name the request
    that stores a chunk and the chunk's index (a write_back store happens while another request evicts), so
    the twin would not follow the Python tier (which reads the tier cache's own tree, or cannot run at all).
    Such tiers run in the Python core."""
    key = (tier.policy, json.dumps(tier.policy_params, sort_keys=True, default=repr))
    got = _TIER_SAFE.get(key)
    if got is None:
        from kvlab.policies import make_policy

        got = _TIER_SAFE[key] = _tier_safe(make_policy(tier.policy, **tier.policy_params))
    return got


_TIER_SAFE: dict[tuple[str, str], bool] = {}


def _tier_safe(pol: object) -> bool:
    if pol.compiled is None:  # type: ignore[attr-defined]
        return False
    probe = _probe()
    pol.prepare(probe)  # type: ignore[attr-defined]
    per_block = len(probe.key_ids)
    params = pol.compiled_params()  # type: ignore[attr-defined]
    return not any(np.ndim(a) and np.shape(a)[-1] == per_block for a in _arrays(params))


def _arrays(params: object) -> list:
    return [a for p in params for a in _arrays(p)] if isinstance(params, tuple) else [params]


@functools.lru_cache(maxsize=1)
def _probe() -> object:
    """A small encoded workload: 61 full blocks (1-token blocks), 2 requests; no parameter array is that long."""
    from kvlab.hashing import BlockHasher, encode_workload
    from kvlab.workload.workload import from_lists

    w = from_lists([list(range(20)), list(range(41))], arrival=np.arange(2, dtype=float))
    return encode_workload(w, BlockHasher("xxh3_64"), 1)
