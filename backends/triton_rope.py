"""The Triton backend: our kernels (backends/triton_kernels.py) through one op path.

Every way in ends in the launcher (backends/triton_launch.py):

- eager, no gradient: outputs allocated, :func:`launch`;
- eager with a gradient: :class:`RoPEFunction`, the one ``torch.autograd.Function``, whose
  backward is the transposed launch (a norm stage's backward also sums the weights' gradients);
- ``torch.compile``, tensor subclasses or a dispatch mode: the custom op
  ``rope_dispatch::triton_rope`` with its fake and its autograd formula (the op transposed),
  so ``fullgraph=True`` holds and a selective checkpoint policy sees one op (a compiled
  in-place call that needs no gradient: its mutating twin ``rope_dispatch::triton_rope_``);
- a repeated call: its plan binds the compiled launch with its constant arguments, one call
  into C;
- a call with a cache stage (:func:`rope_to_cache`): one launch that norms (optionally),
  rotates, quantizes (FP8) and writes q to its output and k and v into the KV cache.

The backward keeps only tables and index tensors (and a norm stage's inputs) and returns each
gradient in its input's layout where that is dense. With ``TRITON_INTERPRET=1`` set before the
first use the kernels run on the CPU (for CI).
"""

from __future__ import annotations

import ast
import functools
import os
from typing import Any

import torch
from torch.autograd.graph import increment_version

from rope_dispatch.call import TENSOR_KINDS, RoPECall, position_index
from rope_dispatch.overlap import _shares, expanded_dim
from rope_dispatch.errors import RoPEError
from rope_dispatch.kv_cache import FP8_DTYPES
from rope_dispatch.registry import Backend, Plan
from rope_dispatch.spec import dtype_name
from rope_dispatch.tables import angles_2d, kernel_tables, table_tensors
from rope_dispatch.tracing import (
    PLAIN_TENSORS, _dispatch_modes, exact_size, forward_ad, transformed,
)

from . import triton_launch as tl
from . import triton_tables as tt
from .triton_launch import (
    Launch, LaunchKey, NormTensors, Slots, Tables, bound, call_tables, describe, launch, outputs,
    run,
)
from .eager import rope_eager, rope_to_cache_eager
from .written import door_words, library, refuse_written_once, worded, written_apart
from .triton_tables import current_stream, on_device

# torch.autograd.graph.increment_version's C entry, without its Python wrapper (a tensor or a
# sequence of them; tensors made under inference mode, which have no counter, skipped)
_bump = getattr(torch._C, "_increment_version", increment_version)

# ---------------------------------------------------------------------------------------------
# One autograd Function


class Rotation:
    """One call's launch for autograd: its descriptor and tables, or for a planned call the
    plan's bound launches (:class:`Planned`) with the call's own table (``freqs``), start or
    per-token positions (``index``; ``None``: by index), ``cu_seqlens`` and stream."""

    __slots__ = ("launch", "tabs", "planned", "freqs", "index", "cu_seqlens", "stream")

    def __init__(self, launch: Launch, tabs: Tables | None, planned: Planned | None = None,
                 freqs: object = None, index: torch.Tensor | None = None,
                 cu_seqlens: torch.Tensor | None = None, stream: int = 0):
        self.launch, self.tabs, self.planned = launch, tabs, planned
        self.freqs, self.index, self.cu_seqlens, self.stream = freqs, index, cu_seqlens, stream

    @property
    def data_count(self) -> int:
        """How many of the Function's inputs are data (the rest: norm weights)."""
        kind = self.launch.tensors
        return 2 if kind == "qk" else 3 if kind == "qkv" and self.launch.backward else 1

    def versions(self) -> tuple[tuple[str, int], ...]:
        """The names and version counters of the tensors the backward reads again: the table's
        (the call's, or copies made for it), the norm weights' and the index tensors' (tensors
        made under inference mode have none). The Function's backward raises where one moved
        since the forward, as autograd does for any tensor it keeps (eager's backward keeps the
        cos and sin its forward gathered, and the forward's weights)."""
        tabs, planned = self.tabs, self.planned
        q_name, k_name = "the table (freqs)", "k's table (k_freqs)"
        named = ([(q_name, t) for t in table_tensors(self.freqs)] if tabs is None else [
            (q_name, tabs.table), (q_name, tabs.sin), (k_name, tabs.k_table), (k_name, tabs.k_sin)])
        held = [(name, t) for name, t in named if t is not None and t.dtype is not tt.FLAG]
        if tabs is not None and tabs.norm is not None:
            held += [("a norm weight (HeadNorm.weight)", w) for w in tabs.norm.weights]
        if planned is not None:
            index, cu, per_token = self.index, self.cu_seqlens, planned.per_token
        else:  # (on sbhd and bshd a halves flag rides in cu_seqlens' slot)
            index, cu = tabs.index, tabs.cu if self.launch.layout == "thd" else None
            per_token = index is not None and index.dim() == 2
        held += [("positions" if per_token else "start_positions", index),
                 ("spec.cu_seqlens", cu)]
        return tuple((name, t._version) for name, t in held
                     if t is not None and not t.is_inference())

    def tables(self) -> Tables:
        if self.tabs is None:
            self.tabs = self.planned.tables(self.freqs, self.index, self.cu_seqlens)
        return self.tabs

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.planned is not None:
            index = self.planned.address if self.index is None else self.index
            made = self.planned.forward(self.stream, *inputs, index)
            if made is not NotImplemented:
                return made if isinstance(made, tuple) else (made,)
            self.tables()  # an unaligned tensor: the generic launch
        return run(self.launch, inputs, self.tabs)

    def backward(self, grads: tuple[torch.Tensor, ...], strides: tuple,
                 sources: tuple[torch.Tensor, ...] = ()) -> tuple:
        """The transposed launch on ``grads``: in place where the call allowed it and the
        gradients are writable, the plan's bound launch where it serves them, else the
        generic launch into gradients laid out as the inputs (``strides``); differentiable
        under double backward. With a norm stage (``sources``: the forward's inputs) the
        launch also sums the weights' gradients, which follow the inputs' gradients."""
        forward, planned = self.launch, self.planned
        grad_enabled = torch.is_grad_enabled()
        if forward.norm is not None:
            if grad_enabled:
                raise RoPEError(
                    "a second derivative through a norm stage (HeadNorm) is not supported by the "
                    "triton backend; use backend='eager' for double backward"
                )
            return self._norm_backward(grads, strides, sources)
        if not grad_enabled and forward.grad_in_place and all(
                expanded_dim(g) is None for g in grads) and not (
                len(grads) == 2 and _shares(grads[0], grads[1])):  # one given to q and k
            return run(forward.transposed(in_place=True), grads, self.tables())
        if not grad_enabled and planned is not None and planned.back_ready(grads, self.freqs,
                                                                           self.stream):
            made = planned.back(self.stream, *grads,
                                planned.address if self.index is None else self.index)
            if made is not NotImplemented:
                return made if isinstance(made, tuple) else (made,)
        back = forward.transposed()
        if grad_enabled:  # double backward: the transpose must be differentiable
            made = RoPEFunction.apply(Rotation(back, self.tables()), *grads)
            return made if isinstance(made, tuple) else (made,)
        return run(back, grads, self.tables(), strides)

    def _norm_backward(self, grads: tuple[torch.Tensor, ...], strides: tuple,
                       sources: tuple[torch.Tensor, ...]) -> tuple:
        back = self.launch.transposed()
        tabs = self.tables()
        weights = tabs.norm.weights
        tabs = tabs._replace(norm=NormTensors(weights, sources))
        outs = outputs(back, grads, strides)
        with on_device(grads[0]):
            partials = tl.norm_partials(back, grads, outs, tabs)
            launch(back, grads, outs, tabs._replace(norm=NormTensors(weights, sources, partials)))
            summed = tl.weight_grads(partials, weights)
        return (*outs, *summed)


class RoPEFunction(torch.autograd.Function):
    """Autograd of every eager launch: the forward runs the rotation's launch (in place marks
    its inputs dirty), the backward its transpose (itself differentiable); only tables and
    index tensors are kept, and a norm stage's inputs (its weights are the Function's last
    inputs, their gradients summed by the backward's launch)."""

    @staticmethod
    def forward(ctx, rotation: Rotation, *inputs: torch.Tensor):
        data = inputs[:rotation.data_count]
        sources = ()
        if rotation.launch.norm is not None:  # the norm's backward reads the forward's inputs
            sources = tuple(x.clone() for x in data) if rotation.launch.in_place else data
            ctx.save_for_backward(*sources)
        ctx.versions = rotation.versions()
        made = rotation.forward(data)
        if rotation.launch.in_place:
            ctx.mark_dirty(*data)
        if rotation.launch.tensors == "qk":  # a side that wants no gradient gets none, as apply
            weights, idle = iter(inputs[len(data):]), []
            for x, out, form in zip(data, made, rotation.launch.norm or (None, None)):
                weight = None if form is None else next(weights)
                if not (x.requires_grad or (weight is not None and weight.requires_grad)):
                    idle.append(out)
            ctx.mark_non_differentiable(*idle)
        ctx.rotation = rotation
        ctx.strides = tuple(tl.dense_strides(x) for x in data)
        if len(made) == 2:  # a side whose output is unused gets no gradient, as apply's
            ctx.set_materialize_grads(False)
            ctx.likes = tuple((x.shape, x.dtype, x.device) for x in made)
        return made[0] if len(made) == 1 else made

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        rotation = ctx.rotation
        moved = [name for (name, v), (_, w) in zip(ctx.versions, rotation.versions()) if v != w]
        if moved:
            raise RoPEError(
                f"{moved[0]} was modified in place between the forward and the backward of the "
                "triton backend's RoPE, whose backward reads it again: run the forward again, "
                "or write a copy"
            )
        unused = [g is None for g in grads]
        if not any(unused):  # (the Function gets no call when both of a pair's are unused)
            return (None, *rotation.backward(grads, ctx.strides, ctx.saved_tensors))
        grads = tuple(_filled(grads, ctx.likes))
        made = rotation.backward(grads, ctx.strides, ctx.saved_tensors)
        # the unused side's input and norm weight get None, as apply gives them
        forms = rotation.launch.norm or ()
        sides = unused + [unused[i] for i, form in enumerate(forms) if form is not None]
        return (None, *(None if idle else g for g, idle in zip(made, sides)))


def _filled(grads: Any, likes: Any) -> list[torch.Tensor]:
    """``grads`` with an unused output's ``None`` as zeros like that output (``likes``: each
    output's shape, dtype and device): the transposed launch takes every gradient."""
    return [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, likes)]


def c_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` without torch's Python wrapper (its C entry, bound to ``function``),
    for calls outside functorch transforms on tensors a plan's guard found plain, where the
    wrapper (default arguments, functorch unwrapping) would do nothing."""
    return super(torch.autograd.Function, function).apply


# ---------------------------------------------------------------------------------------------
# One custom op, for tracing


@functools.lru_cache(maxsize=512)
def _decoded(described: str) -> Launch:
    return Launch(**ast.literal_eval(described))


def op_launch(described: Launch, in_place: bool = False) -> str:
    """``described`` as the custom ops take it: its fields, with no stage; out of place but for
    :func:`triton_rope_inplace_op`'s."""
    return repr(described._replace(in_place=in_place, grad_in_place=False, norm=None,
                                   store=None)._asdict())


@torch.library.custom_op("rope_dispatch::triton_rope", mutates_args=())
def triton_rope_op(
    inputs: list[torch.Tensor], table: torch.Tensor, sin: torch.Tensor | None,
    k_table: torch.Tensor | None, k_sin: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    index: torch.Tensor | None, described: str, written: int, words: str,
) -> list[torch.Tensor]:
    """A launch (:func:`op_launch`) as an opaque op for torch.compile: new contiguous outputs.
    ``written``: a traced in-place call's rotary dim, whose memory checks the op runs first on
    the graph's real tensors (:func:`~.written.refuse_written_once`); else 0. (No default: the
    dispatcher drops an argument equal to its default, which changes the backward's arity.)
    ``words``: a door's (``written.door``), added to a refusal."""
    launch = _decoded(described)
    if written:
        with worded(words):
            refuse_written_once(inputs[0], inputs[1] if len(inputs) > 1 else None, None, None,
                                (table,) if sin is None or sin is table else (table, sin),
                                written, launch.offset)
    return list(run(launch, inputs, Tables(table, sin, cu_seqlens, index, k_table, k_sin)))


def _rotate_in_place(inputs, table, sin, k_table, k_sin, cu_seqlens, index, described,
                     checked) -> None:
    run(_decoded(described), inputs, Tables(table, sin, cu_seqlens, index, k_table, k_sin))
    _bump(inputs)


library.define("triton_rope_(Tensor(a!)[] inputs, Tensor table, Tensor? sin, Tensor? k_table, "
               "Tensor? k_sin, Tensor? cu_seqlens, Tensor? index, str described, "
               "Tensor checked) -> ()")
library.impl("triton_rope_", _rotate_in_place, "CompositeExplicitAutograd")
torch.library.register_fake("rope_dispatch::triton_rope_", lambda *args: None, lib=library)
triton_rope_inplace_op = torch.ops.rope_dispatch.triton_rope_.default
""":func:`triton_rope_op` rotating ``inputs`` in place, for a traced in-place call that needs no
gradient (an op that mutates has no autograd formula): one launch, where the functional op's
outputs cost an allocation and a copy back into each input. ``checked``: the result of the
call's memory checks (:func:`~.written.written_apart`), run before on its own tensors: where
another argument reads their memory, Inductor hands this op copies, on which an overlap no
longer shows. Defined on the dispatcher directly: ``custom_op``'s wrapper of an op that
mutates cost 34 us a call (development CPU)."""


@triton_rope_op.register_fake
def _triton_rope_fake(inputs, table, sin, k_table, k_sin, cu_seqlens, index, described,
                      written, words):
    return list(outputs(_decoded(described), inputs))


def _op_setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs[1:7])
    ctx.described = inputs[7]
    ctx.likes = [(o.shape, o.dtype, o.device) for o in output]
    ctx.set_materialize_grads(False)  # an unused output's None reaches the backward


def _op_backward(ctx: Any, grads: list[torch.Tensor | None]):
    unused = [g is None for g in grads]  # an output unused: its input gets None, as apply's
    back = op_launch(_decoded(ctx.described).transposed())
    made = triton_rope_op(_filled(grads, ctx.likes), *ctx.saved_tensors, back, 0, "")
    if len(made) == len(unused):  # (a packed qkv call: one input, its gradient in one piece)
        made = [None if idle else g for g, idle in zip(made, unused)]
    return (made,) + (None,) * 9


triton_rope_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ---------------------------------------------------------------------------------------------
# The eager and traced entry


def _traced(*tensors: torch.Tensor) -> bool:
    """Whether the call goes to the custom op: while ``torch.compile`` traces, for tensor
    subclasses, or under a torch dispatch mode (selective activation checkpointing's, whose
    policy must see one op it can save or recompute, not the launch's allocations and the
    interpreter's copies). Asked before anything reads a tensor's host-side state
    (``is_inference``, ``data_ptr``, ``_version``, a table's flag), which a trace refuses; the
    op then takes the table's plain kernel form."""
    return torch.compiler.is_compiling() or _dispatch_modes() > 0 or any(
        type(t) not in PLAIN_TENSORS for t in tensors)


def _constants(described: Launch, call: RoPECall) -> Launch:
    """A traced call's launch with plain numbers: Dynamo (``dynamic=True``) reads the numbers
    an object holds as symbols, which the op's text argument cannot hold."""
    split = described.split
    return described._replace(
        scale=float(call.spec.scale_text), cp_size=exact_size(described.cp_size),
        cp_rank=exact_size(described.cp_rank), offset=exact_size(described.offset),
        split=None if split is None else tuple(exact_size(n) for n in split))


def _result(launch: Launch, made: tuple) -> Any:
    return made[0] if launch.tensors == "t" else tuple(made)


def rope(call: RoPECall) -> Any:
    """A checked call through the kernels: new outputs, or the inputs rotated in place (a
    packed qkv call returns ``(q, k, v)``, a pair ``(q, k)``)."""
    if transformed() or forward_ad():  # torch.func's wrappers have no memory to launch on,
        return rope_eager(call)  # a dual tensor's tangent no launch carries: torch ops
    described = describe(call)
    inputs = (call.t,) if call.k is None else (call.t, call.k)
    weights = () if described.norm is None else tuple(
        n.weight for n in (call.norm, call.k_norm) if n is not None)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*inputs, *weights))
    if _traced(*inputs, *weights):
        if described.norm is not None:  # traced: the float32 composition, for Inductor to fuse
            return rope_eager(call)
        table, sin = kernel_tables(call.table)
        k_table, k_sin = (None, None) if call.k_table is None else kernel_tables(call.k_table)
        if described.tensors == "qkv" and k_table is None:
            k_table, k_sin = table, sin
        checked = described.in_place and torch.compiler.is_compiling()
        args = (list(inputs), table, sin, k_table, k_sin, call.spec.cu_seqlens,
                position_index(call))
        constant = _constants(described, call)
        if checked and not grad:
            triton_rope_inplace_op(*args, op_launch(constant, in_place=True),
                                   written_apart(call, filled=False))
            return _result(described, inputs)
        made = triton_rope_op(*args, op_launch(constant), exact_size(call.rotary_dim) if checked
                              else 0, door_words() if checked else "")
        if described.in_place:  # (the op checked the memory of a compiled call first)
            made = [x.copy_(out) for x, out in zip(inputs, made)]
        return _result(described, made)
    if described.tensors == "qk" and (
        not (inputs[0].shape[-2] and inputs[1].shape[-2])
        or (described.in_place and grad and (inputs[0]._is_view() or inputs[1]._is_view()))
    ):
        # one launch tiles both sides, and torch lets a Function that rotates a view in place
        # return only that tensor: one call each
        return tuple(rope(call._replace(t=x, k=None, heads=x.shape[-2], tensors="t", norm=n,
                                        k_norm=None))
                     for x, n in zip(inputs, (call.norm, call.k_norm)))
    tabs = call_tables(call)
    if grad:
        with on_device(inputs[0]):
            return RoPEFunction.apply(Rotation(described, tabs), *inputs, *weights)
    made = run(described, inputs, tabs)
    if described.in_place:
        _bump(inputs)
    return _result(described, made)


def rope_to_cache(call: RoPECall) -> torch.Tensor:
    """A checked call with a cache stage (:func:`~rope_dispatch.rope_to_cache`) in one launch:
    q into ``q_out`` (new where none was given), k rotated and v into the cache's pages at each
    token's slot. No host read of any index or scale, no allocation but q's output (and copies
    of index tensors that are not contiguous): capturable in a CUDA graph. Traced by
    ``torch.compile`` (or on tensor subclasses) it is the eager composition, as is a call whose
    q or k has no heads (the launch tiles both sides, and launches nothing where one is empty)."""
    write = call.cache_write
    q, k, v = call.t, call.k, write.v
    weights = tuple(n.weight for n in (call.norm, call.k_norm) if n is not None)
    if (transformed() or forward_ad() or _traced(q, k, v, *weights)
            or not (q.shape[-2] and k.shape[-2])):
        return rope_to_cache_eager(call)  # (a dual tensor's tangent: torch ops carry it)
    q_out = write.q_out if write.q_out is not None else q.new_empty(q.shape, dtype=write.q_dtype)
    k_pages, v_pages = write.cache.pages()
    with on_device(q):
        launch(describe(call), (q, k, v), (q_out, k_pages, v_pages), call_tables(call))
    # one call for the three; tensors made under inference mode have no counter to move
    _bump((write.cache.k_cache, write.cache.v_cache, q_out))
    return q_out


# ---------------------------------------------------------------------------------------------
# Plans


class Planned:
    """A plan's launches: the forward bound from the call it was made for, the transposed
    launch bound at the first backward that finds it compiled. Holds addresses and compiled
    kernels, never tensors (but a table's flag, read by address)."""

    __slots__ = ("forward", "back_key", "back_slots", "back", "address", "flag", "rows",
                 "per_token", "launch")

    def __init__(self, forward: Any, back_key: LaunchKey, back_slots: Slots, address: int,
                 flag: torch.Tensor | None, rows: int, per_token: bool, described: Launch):
        self.forward, self.back_key, self.back_slots = forward, back_key, back_slots
        self.back: Any = None
        self.address, self.flag, self.rows, self.per_token = address, flag, rows, per_token
        self.launch = described

    def tables(self, freqs: object, index: torch.Tensor | None,
               cu_seqlens: torch.Tensor | None) -> Tables:
        """The call's tables in kernel form, flags checked, for a launch the plan did not bind."""
        table = angles_2d(freqs) if isinstance(freqs, torch.Tensor) else freqs
        tab, sin, cu = tt.launch_tables(table, self.rows, cu_seqlens, self.launch.layout,
                                        self.launch.interleaved)
        if index is not None and self.per_token and index.dim() == 1:
            index = index.unsqueeze(-1)
        return Tables(tab, sin, cu, index)

    def back_ready(self, grads: tuple[torch.Tensor, ...], freqs: object, stream: int) -> bool:
        """Whether the bound transposed launch may serve ``grads``: contiguous, as the forward's
        outputs were, the flag fresh, and the transposed kernel compiled (bound here once)."""
        if not all(g.is_contiguous() for g in grads) or (
                self.flag is not None and tt.flag_stale(self.flag, freqs, stream)):
            return False
        if self.back is None:
            entry = tl._compiled.get(self.back_key)
            self.back = None if entry is None else bound(entry, self.back_slots)
        return self.back is not None


def plan(call: RoPECall, generic: Plan) -> Plan:
    """The plan of a call (any tensor kind, in place or not, by index, start or per-token
    positions, thd with its spec's cu_seqlens read by address): the compiled launch the call
    just ran, bound (:func:`bound`) so a repeated call is the plan's checks and one launch.
    With a gradient (out of place; inputs contiguous, or strided views such as MLA's rope
    channels, whose gradients are contiguous too), :class:`RoPEFunction` runs the bound
    forward and, from the first backward that finds it compiled, the bound transpose.
    ``generic`` serves what binding does not cover: a launch not compiled or not aligned, a
    table copied for the call, another device current, a written table's stale flag."""
    described = describe(call)
    inputs = (call.t,) if call.k is None else (call.t, call.k)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    if call.k_table is not None or (described.norm is not None and grad) or (grad and (
            described.in_place or any(tl.dense_strides(x) is not None for x in inputs))):
        return generic  # (a dense permuted input's gradient keeps its layout: the generic path)
    tabs = call_tables(call)  # a norm stage's weights too (a plan binds their addresses)
    if not _reads_given_tables(call, tabs):
        return generic
    tabs = tl.current_tables(tabs, described.layout)
    outs = inputs if described.in_place else outputs(described, inputs)
    # a norm stage's weights (q's, k's: its sides) are taken from the call's norms, as its data
    sides = [i for i, w in enumerate(tabs.norm.weights if tabs.norm else ()) if w is not None]
    weights = tuple(tabs.norm.weights[i] for i in sides)
    binding = tl.bind_compiled(described, inputs, outs, tabs, (*inputs, tabs.index, *weights),
                               () if described.in_place else outs)
    if binding is None:
        return generic
    forward, key = binding
    device, address = key.device, tabs.table.data_ptr()
    flag = tt.plan_flag(tabs.sin, tabs.cu, described.layout)
    several, current_device, stream, stale = (
        tt.several_gpus(), torch.cuda.current_device, current_stream, tt.flag_stale)
    in_place, pair = described.in_place, described.tensors == "qk"

    one = sides[0] if len(sides) == 1 else None  # a single norm's side

    if not grad:
        def run(x: torch.Tensor, freqs: object, spec: Any, start_positions: Any, positions: Any,
                k: Any, norms: tuple) -> Any:
            given = positions if start_positions is None else start_positions
            s = stream(device)
            if (several and current_device() != device) or forward_ad() or (
                    flag is not None and stale(flag, freqs, s)):
                return generic(x, freqs, spec, start_positions, positions, k, norms)
            index = address if given is None else given
            if not sides:
                made = forward(s, x, k, index) if pair else forward(s, x, index)
            elif one is not None:
                w = norms[one].weight
                made = forward(s, x, k, index, w) if pair else forward(s, x, index, w)
            elif pair:
                made = forward(s, x, k, index, norms[0].weight, norms[1].weight)
            else:  # a packed qkv's q and k norms
                made = forward(s, x, index, norms[0].weight, norms[1].weight)
            if made is NotImplemented:  # an unaligned tensor
                return generic(x, freqs, spec, start_positions, positions, k, norms)
            if not in_place:
                return made
            if not pair:
                _bump(x)
                return x
            _bump((x, k))
            return x, k

        return run

    back = described.transposed()
    back_outs = outputs(back, outs)
    back_sources = tl.pointers(back, outs, back_outs, tabs)
    back_key = tl.launch_key(back, outs, back_outs, tabs,
                             tuple(t.data_ptr() + offset for t, offset in back_sources))
    planned = Planned(forward, back_key, tl.slots(back_sources, (*outs, tabs.index), back_outs),
                      address, flag, tt.rows_read(call.t, call.spec.layout, position_index(call)),
                      call.positions is not None, described)
    apply = c_apply(RoPEFunction)

    def run_grad(x: torch.Tensor, freqs: object, spec: Any, start_positions: Any, positions: Any,
                 k: Any, norms: tuple) -> Any:
        given = positions if start_positions is None else start_positions
        s = stream(device)
        if (several and current_device() != device) or transformed() or _dispatch_modes() or (
                forward_ad() or flag is not None and stale(flag, freqs, s)):
            return generic(x, freqs, spec, start_positions, positions, k, norms)
        rotation = Rotation(described, None, planned, freqs, given, spec.cu_seqlens, s)
        return apply(rotation, x, k) if pair else apply(rotation, x)

    return run_grad


def _reads_given_tables(call: RoPECall, tabs: Tables) -> bool:
    """Whether the launch reads the call's own table, cu_seqlens and index, a cache stage's
    own index tensors and the norms' own weights (none copied for the call): a bound launch
    takes their addresses from the tensors a repeated call passes."""
    store = () if tabs.store is None else tabs.store.index
    weights = (None, None) if tabs.norm is None else tabs.norm.weights
    return tabs.table.data_ptr() == tt.user_table_address(call) and all(
        t is None or t.is_contiguous() for t in (tabs.cu, tabs.index, *store)) and all(
        w is None or w is n.weight for w, n in zip(weights, (call.norm, call.k_norm)))


def plan_cache(call: RoPECall) -> Any:
    """The plan of a :func:`rope_to_cache` call (``run(freqs, tensors)``, ``tensors`` as
    dispatch's ``_cache_form`` orders them, then the norm weights): the compiled
    launch the call just ran, bound, so a repeated decode step is the plan's guard and one
    launch. ``None`` where binding does not cover the call (not compiled or not aligned, a
    table or index copied for it, an FP8 q made with no tensor of its dtype to allocate like);
    a run returns ``NotImplemented`` where dispatch must check the call (another device current,
    a stale table flag, a tensor not aligned)."""
    write = call.cache_write
    q, k, v = call.t, call.k, write.v
    described, tabs = describe(call), call_tables(call)
    if not _reads_given_tables(call, tabs):
        return None
    tabs = tl.current_tables(tabs, described.layout)
    k_pages, v_pages = write.cache.pages()
    new = write.q_out is None
    like = 0 if write.q_dtype == q.dtype else 4 if write.q_dtype == k_pages.dtype else None
    if new and like is None:
        return None
    q_out = q.new_empty(q.shape, dtype=write.q_dtype) if new else write.q_out
    # the objects the launch's pointers name, where a call passes tensors of the same addresses
    # (the caches for their page views, positions for its index view, scales for their 0-d views)
    scales = tuple(s for s in (write.cache.k_scale, write.cache.v_scale, write.q_scale)
                   if isinstance(s, torch.Tensor))
    given = (q, k, v, tabs.index, k_pages, v_pages, *tabs.store.index, *scales,
             *(() if new or q_out is q else (q_out,)),
             *(w for w in (tabs.norm.weights if tabs.norm is not None else ()) if w is not None))
    binding = tl.bind_compiled(described, (q, k, v), (q_out, k_pages, v_pages), tabs, given,
                               (q_out,) if new else (), (like,))
    if binding is None:
        return None
    forward, key = binding
    # q_out's place among the tensors a call passes (q's in place)
    device, at = key.device, 0 if q_out is q else 6 + len(tabs.store.index) + len(scales)
    flag = tt.plan_flag(tabs.sin, tabs.cu, described.layout)
    several, current_device, stream, stale = (
        tt.several_gpus(), torch.cuda.current_device, current_stream, tt.flag_stale)

    def run(freqs: object, tensors: tuple[torch.Tensor, ...]) -> Any:
        s = stream(device)
        if (several and current_device() != device) or forward_ad() or (
                flag is not None and stale(flag, freqs, s)):
            return NotImplemented
        made = forward(s, *tensors)
        if made is NotImplemented:
            return made
        out = made if new else tensors[at]
        _bump((tensors[4], tensors[5], out))  # the caches and q's output
        return out

    return run


class TritonBackend(Backend):
    """Our Triton kernels: every layout and feature, every table kind, at memory bandwidth."""

    name = "triton"
    description = (
        "rope-dispatch's own Triton kernels (CUDA; CPU through TRITON_INTERPRET=1): one pass, "
        "fp32 math, any strides, angles, cos/sin caches or rates"
    )
    priority = 40
    supports_in_place = True
    supports_norm = True
    supports_inverse = True
    supports_rotary_offset = True
    supports_deinterleave = True
    supports_cache_write = True
    supports_cache_v_head_dim = True
    supports_positions = True
    tables = frozenset(
        {"angles", "cos_sin_cache", "pair_cos_sin_cache", "rates", "precise_rates"}
    )
    tensors = frozenset(TENSOR_KINDS)

    @property
    def devices(self) -> frozenset[str]:  # type: ignore[override]
        if not self.availability and tl._kernels is not None and tl._kernels.INTERPRETED:
            return frozenset({"cpu", "cuda"})
        return frozenset({"cuda"})

    def unavailable_reasons(self) -> list[str]:
        try:
            import triton
        except ImportError as exc:
            return [f"triton is not importable ({exc}); install it with pip install 'rope-dispatch[triton]'"]
        # as Triton reads it (1, true, on, yes, any case: its knobs, Triton 3.4 on), since
        # Triton's decorator decides from it whether the kernels are interpreted
        knobs = getattr(triton, "knobs", None)
        raw = os.environ.get("TRITON_INTERPRET")
        interpret = bool(knobs.runtime.interpret) if knobs is not None else raw == "1"
        if not interpret and not torch.cuda.is_available():
            return [
                "no CUDA device (torch.cuda.is_available() is False) and TRITON_INTERPRET is "
                + ("unset" if raw is None else f"{raw!r}, which Triton reads as off")
                + " (1 runs the kernels on the CPU), so the kernels have nowhere to run"
            ]
        kernels = tl._load_kernels()
        if interpret and not kernels.INTERPRETED:
            return [
                "TRITON_INTERPRET=1 was set after the kernels had been compiled for the GPU; set "
                "it before rope_dispatch's first call"
            ]
        if not interpret and kernels.INTERPRETED and not torch.cuda.is_available():
            return ["the kernels were loaded for the interpreter but TRITON_INTERPRET is unset"]
        return []

    def extra_reasons(self, call: RoPECall) -> list[str]:
        """The cache stage's FP8 stores: not on the interpreter, whose float8 conversion is not
        a cast (it drops the rounding's carry into the exponent, and neither saturates nor
        keeps inf and NaN), nor float8_e4m3fn on a GPU older than compute capability 8.9
        (Triton converts to it from sm_89 on). A norm stage with rotary channels past a head's
        first channel or deinterleaved pairs: the norm kernel's channels start at 0, in pairs
        as read."""
        spec = call.spec
        if (spec.rotary_offset or spec.deinterleave) and (
                call.norm is not None or call.k_norm is not None):
            named = (f"spec.rotary_offset={spec.rotary_offset}" if spec.rotary_offset
                     else "spec.deinterleave=True")
            return [
                f"a norm stage (HeadNorm) with {named}: the Triton norm kernel rotates a head's "
                "first channels, pairs where they are read; the eager backend composes them"
            ]
        write = call.cache_write
        if write is None:
            return []
        fp8 = sorted({dtype_name(d) for d in (write.cache.dtype, write.q_dtype)
                      if d in FP8_DTYPES})
        if not fp8:
            return []
        what = f"an FP8 cache or q output ({', '.join(fp8)})"
        if tl._kernels is not None and tl._kernels.INTERPRETED:
            return [
                f"{what} under TRITON_INTERPRET=1: the interpreter's float8 conversion rounds "
                "wrongly (no carry into the exponent, no saturation); FP8 stores run on a GPU"
            ]
        device = call.t.device
        if device.type == "cuda" and "float8_e4m3fn" in fp8:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                return [
                    f"{what}: Triton converts to float8_e4m3fn on compute capability 8.9 or "
                    f"newer, and {torch.cuda.get_device_name(device)} is {major}.{minor}"
                ]
        return []

    def plan(self, call: RoPECall) -> Plan | None:
        generic = super().plan(call)
        if tl._kernels is None or tl._kernels.INTERPRETED:
            return generic
        if call.cache_write is not None:
            return plan_cache(call)
        return plan(call, generic)

    def apply(self, call: RoPECall) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if call.cache_write is not None:
            return rope_to_cache(call)
        return rope(call)

    def quantize(self, x: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
        """``out[...] = x / scale`` cast to ``out``'s FP8 dtype, as the cache stage stores
        (:func:`triton_launch.quantize`); ``False`` where it does not serve."""
        return x.device.type in self.devices and tl.quantize(x, out, scale)
