"""The direct launcher (backends/direct_launch.c): one C call that allocates a kernel's outputs
and launches it.

On the CPU the module is built as on a GPU machine and launches through a stand-in driver (a
small shared library compiled here) that records what each launch was given: the parameter
values must be the inputs' and outputs' addresses plus their offsets and the constants packed
as the kernel's types say, the geometry the compiled kernel's. The stand-in replaces the
driver for the whole process, so those checks run in a child process. On a GPU the planned
calls (single tensors, q and k pairs, packed qkv; forward and backward) launch through it,
matched against the float64 reference."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from reference import reference_forward_backward, reference_qkv_forward_backward

from rope_dispatch.backends import direct_launch

STAND_IN = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
void *current_context = (void *)0x1000;
void *pushed_context = 0;
int n_params = 0;
int fail = 0;
int launches = 0;
uint64_t seen_params[64];
uint64_t seen_launch[9];  /* function, grid x y z, block x y z, shared memory, stream */
CUresult cuCtxGetCurrent(void **context) { *context = current_context; return 0; }
CUresult cuCtxPushCurrent_v2(void *context) { pushed_context = context; return 0; }
CUresult cuCtxPopCurrent_v2(void **context) { *context = pushed_context; return 0; }
CUresult cuGetErrorString(CUresult code, const char **text) {
    *text = "stand-in failure"; return 0;
}
CUresult cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void *stream,
                        void **params, void **extra) {
    if (fail) return fail;
    uint64_t launch[9] = {(uint64_t)function, gx, gy, gz, bx, by, bz, shared,
                          (uint64_t)stream};
    memcpy(seen_launch, launch, sizeof launch);
    for (int i = 0; i < n_params; ++i) memcpy(&seen_params[i], params[i], 8);
    ++launches;
    return 0;
}
"""

# Run in the child: bind a launch of a made-up kernel, call it, report what the driver saw.
CHILD = r"""
import ctypes, json, struct, sys
import torch
from rope_dispatch.backends import direct_launch

driver = ctypes.CDLL(sys.argv[1])
module = direct_launch.build()
module.open_driver(sys.argv[1])
direct_launch._module = module  # bind launches through the stand-in
types = ("*bf16", "*bf16", "i32", "constexpr", "fp32", "i64", "*i64", "i1")
args = (0, 0, -7, 64, 0.5, 2**40 + 3, 0, 1)
prefix = (0xABC0, 0, 0, None, None, (4, 1, 96), None, None, None)  # _direct_launcher's layout
report = {}
launch = direct_launch.bind(prefix, (3, 2, 1), types, args, 2, ((0, 0, 16), (1, 6, 0)),
                            ((0, (5, 3)),), ((0, 1, 8),))
ctypes.c_int.in_dll(driver, "n_params").value = 9
x = torch.randn(5, 3).to(torch.bfloat16)
index = torch.arange(4)
out = launch(77, x, index)
seen = lambda: list((ctypes.c_uint64 * 9).in_dll(driver, "seen_params"))
report["out"] = [list(out.shape), str(out.dtype), out.data_ptr() != x.data_ptr()]
report["addresses"] = [x.data_ptr(), out.data_ptr(), index.data_ptr()]
report["params"] = seen()
report["geometry"] = list((ctypes.c_uint64 * 9).in_dll(driver, "seen_launch"))
launch(0, x, 12345)  # an address given as an int
report["int_index"] = seen()[5]
ctypes.c_void_p.in_dll(driver, "current_context").value = 0x2000  # another context current
launch(0, x, index)
report["pushed"] = ctypes.c_void_p.in_dll(driver, "pushed_context").value
two = direct_launch.bind(prefix, (1, 1, 1), types, args, 2, (), ((0, (2,)), (1, (3, 4))),
                         ((1, 0, 0), (0, 1, 0)))
made = two(0, x, index)
unaligned = torch.randn(16).to(torch.bfloat16)[1:].view(5, 3)  # 2 bytes past an aligned one
report["unaligned"] = launch(0, unaligned, index) is NotImplemented
report["two"] = [type(made).__name__, [list(t.shape) for t in made], [str(t.dtype) for t in made],
                 seen()[:2] == [made[1].data_ptr(), made[0].data_ptr()]]
errors = {}
for name, call in {"arguments": lambda: launch(0, x), "keywords": lambda: launch(0, x, index, a=1),
                   "stream": lambda: launch("s", x, index),
                   "address": lambda: launch(0, x, object())}.items():
    try:
        call()
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
ctypes.c_int.in_dll(driver, "fail").value = 700
try:
    launch(0, x, index)
except RuntimeError as exc:
    errors["launch"] = str(exc)
report["errors"] = errors
report["launches"] = ctypes.c_int.in_dll(driver, "launches").value
ctypes.c_void_p.in_dll(driver, "current_context").value = None  # no context on this thread
report["bound_without_context"] = repr(direct_launch.bind(
    prefix, (3, 2, 1), types, args, 2, ((0, 0, 16), (1, 6, 0)), ((0, (5, 3)),), ((0, 1, 8),)))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    pytest.importorskip("triton", reason="the module is built with Triton's C build")
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver")
    folder = tmp_path_factory.mktemp("driver")
    (folder / "driver.c").write_text(STAND_IN)
    library = folder / "libdriver.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / "driver.c")],
                   check=True)
    return str(library)


def test_a_launch_passes_addresses_constants_and_geometry_to_the_driver(stand_in):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), stand_in],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    x, out, index = report["addresses"]
    assert report["out"] == [[5, 3], "torch.bfloat16", True]
    packed = [
        x + 16,  # input 0 plus its offset
        out + 8,  # the new output plus its offset
        struct.unpack("<Q", struct.pack("<i", -7) + b"\0" * 4)[0],  # i32: the low 4 bytes
        # the constexpr takes no slot
        struct.unpack("<I", struct.pack("<f", 0.5))[0],  # fp32's bits
        2**40 + 3,
        index,
        1,  # i1
        0, 0,  # the two scratch pointers, null
    ]
    assert report["params"] == packed
    assert report["geometry"] == [0xABC0, 3, 2, 1, 128, 1, 1, 96, 77]
    assert report["int_index"] == 12345
    assert report["pushed"] is not None and report["pushed"] == 0x1000, (
        "with another context current the launch must push the one it was bound in")
    assert report["unaligned"], "an unaligned input tensor must be refused, not launched"
    assert report["two"] == ["tuple", [[2], [3, 4]], ["torch.bfloat16", "torch.int64"], True]
    errors = report["errors"]
    assert errors["arguments"].startswith("TypeError") and "2 inputs, got 2" in errors["arguments"]
    assert errors["keywords"].startswith("TypeError")
    assert errors["stream"].startswith("TypeError")
    assert "data_ptr" in errors["address"]
    assert "cuLaunchKernel" in errors["launch"] and "700" in errors["launch"]
    assert "stand-in failure" in errors["launch"]
    assert report["launches"] == 4  # the refused and failed calls launched nothing
    assert report["bound_without_context"] == "None", (
        "with no CUDA context current, bind must leave the launch to Triton's launcher")


@pytest.mark.parametrize("change, words", [
    (dict(prefix=(0xABC0, 1, 0, None, None, (4, 1, 0), None, None, None)), "cooperative"),
    (dict(prefix=(0xABC0, 0, 1, None, None, (4, 1, 0), None, None, None)), "PDL"),
    (dict(prefix=(0xABC0, (4, 1, 0), None, None, None)), "another launcher's prefix"),
    (dict(prefix=(0xABC0, 0, 0, None, None, (4, 2, 0), None, None, None)), "a cluster"),
    (dict(types=("*bf16", "nvTmaDesc")), "a type it does not pack"),
    (dict(types=("*bf16",)), "fewer types than arguments"),
    (dict(types=None), "no signature"),
    (dict(takes=((0, 1, 0),), types=("*bf16", "constexpr")), "a constant's slot"),
    (dict(grid=(0, 1, 1)), "an empty grid"),
])
def test_launches_it_cannot_reproduce_are_not_bound(change, words):
    """Where the launch is not one the C call reproduces exactly, bind says so with None and the
    caller keeps Triton's launcher (checked before any module is built or driver opened)."""
    arguments = dict(prefix=(0xABC0, 0, 0, None, None, (4, 1, 0), None, None, None),
                     grid=(1, 1, 1), types=("*bf16", "*bf16"), args=(0, 0), inputs=1,
                     takes=((0, 0, 0),), makes=((0, (2,)),), fills=((0, 1, 0),))
    arguments.update(change)
    assert direct_launch.bind(**arguments) is None, words


def test_parameter_slots_pack_each_type_in_its_own_width():
    slots, where = direct_launch.parameter_slots(
        ("*fp32", "constexpr", "i32", "u16", "fp64", "i64"), (2**48 + 5, 9, -1, 65535, -2.5, -3))
    values = struct.unpack("<7Q", slots)
    assert where == [0, -1, 1, 2, 3, 4]
    assert values[0] == 2**48 + 5
    assert values[1] == 0xFFFFFFFF  # -1 as i32: four bytes, the upper four zero
    assert values[2] == 65535
    assert struct.pack("<Q", values[3]) == struct.pack("<d", -2.5)
    assert values[4] == 2**64 - 3
    assert values[5:] == (0, 0)
    assert direct_launch.parameter_slots(("fp16",), (1.0,)) is None


def test_the_module_builds_and_checks_its_bind_arguments():
    """Built by Triton's C build on any machine with a compiler (CI's too); bind's arguments are
    checked with messages naming them, and no launch is bound before a driver is opened."""
    pytest.importorskip("triton", reason="the module is built with Triton's C build")
    module = direct_launch.build()
    bad = {
        "slots": ((1, (1, 1, 1), 32, 0, bytes(12), 1, (), (), ()), "8-byte"),
        "makes": ((1, (1, 1, 1), 32, 0, bytes(8), 1, (), ((3, (2,)),), ()),
                  "makes[0] names input 3"),
        "takes": ((1, (1, 1, 1), 32, 0, bytes(8), 1, ((0, 4, 0),), (), ()), "takes[0]"),
        "fills": ((1, (1, 1, 1), 32, 0, bytes(8), 1, (), (), ((0, 0, 0),)), "fills[0]"),
    }
    for name, (args, words) in bad.items():
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            module.bind(*args)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="open_driver"):
            module.bind(1, (1, 1, 1), 32, 0, bytes(16), 1, ((0, 0, 0),), ((0, (2,)),),
                        ((0, 1, 0),))


def _check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=2e-2, rtol=2e-2, msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("tensors", ["t", "qk", "qkv"])
@pytest.mark.parametrize("needs_grad", [False, True])
def test_planned_calls_launch_through_one_direct_call(layout, tensors, needs_grad, monkeypatch):
    """On a GPU the planned calls of a single tensor, a q and k pair and packed qkv, with and
    without a gradient, launch through direct calls (each forward and each backward one call),
    and what they compute matches the float64 reference, call after call on new data."""
    import rope_dispatch as rd

    calls = []
    real_bind = direct_launch.bind

    def counting_bind(*args, **kwargs):
        launch = real_bind(*args, **kwargs)
        if launch is None:
            return None
        return lambda *a: calls.append(1) or launch(*a)

    monkeypatch.setattr(direct_launch, "bind", counting_bind)
    seq, batch, heads, d = 16, 2, 4, 64
    lead = (seq, batch) if layout == "sbhd" else (batch, seq)
    freqs = torch.randn(seq, 1, 1, d, dtype=torch.float32, device="cuda")
    spec = rd.RoPESpec(layout=layout, dtype="bf16")
    split = (2 * d, d, d)

    def data(shape, seed):
        torch.manual_seed(seed)
        return torch.randn(shape, device="cuda").to(torch.bfloat16)

    for step in range(4):
        calls.clear()
        if tensors == "qkv":
            source = data((*lead, 2, sum(split)), step)
            leaves = (source.clone().requires_grad_(needs_grad),)
            outs = rd.apply_qkv(leaves[0], freqs, spec, split, backend="triton")
        else:
            sources = (data((*lead, heads, d), step),) + (
                (data((*lead, 1, d), 10 + step),) if tensors == "qk" else ())
            leaves = tuple(x.clone().requires_grad_(needs_grad) for x in sources)
            if tensors == "qk":
                outs = rd.apply_qk(*leaves, freqs, spec, backend="triton")
            else:
                outs = (rd.apply(leaves[0], freqs, spec, backend="triton"),)
        grads = tuple(data(o.shape, 20 + i) for i, o in enumerate(outs))
        if tensors == "qkv":
            expected, expected_grad = reference_qkv_forward_backward(
                source.float(), freqs, freqs, spec, split, tuple(g.float() for g in grads))
            expected_grads = (expected_grad,)
        else:
            pairs = [reference_forward_backward(x.float(), freqs, spec, g.float())
                     for x, g in zip(sources, grads)]
            expected = [out for out, _ in pairs]
            expected_grads = [grad for _, grad in pairs]
        for name, out, ref in zip("qkv", outs, expected):
            _check(out, ref, f"step {step} output {name}")
        if needs_grad:
            got = torch.autograd.grad(outs, leaves, grads)
            for name, grad, ref in zip("qkv", got, expected_grads):
                _check(grad, ref, f"step {step} gradient {name}")
    # by the last step the plan binds both launches: one direct call each way
    assert len(calls) == (2 if needs_grad else 1), (
        f"{len(calls)} direct calls in the last step; {direct_launch.unavailable_reason()}")


def test_a_kept_launch_passes_three_grid_axes_then_its_arguments(monkeypatch):
    """What Triton compiled, kept under a key (``_keep``), is launched again from addresses
    alone (``_run_kept``) with the C launch's layout: three grid axes (a one-axis grid padded
    with 1s), the stream, the launcher's prefix, the pointers, the integers and the constants
    in the kernel's argument order."""
    pytest.importorskip("triton")
    from rope_dispatch.backends import triton_launch

    seen = []

    class Kernel:
        arg_names = ["a", "b", "n", "m", "BLOCK", "ITERS"]

    monkeypatch.setattr(triton_launch, "_direct_launcher",
                        lambda compiled: (lambda *args: seen.append(args), ("fn", "meta")))
    monkeypatch.setattr(triton_launch, "_hooks_active", lambda: False)
    streams = []
    monkeypatch.setattr(triton_launch, "current_stream",
                        lambda device: streams.append(device) or 77)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    key = triton_launch.KernelKey("weight_grad", (7, 8), ("a", "b"), 3, device=5)
    assert not triton_launch._run_kept(key, (100, 200))  # nothing kept yet
    triton_launch._keep(key, Kernel, object(), (5,), 2, (7, 8), {"ITERS": 4, "BLOCK": 16})
    assert triton_launch._run_kept(key, (100, 200))
    assert seen == [(5, 1, 1, 77, "fn", "meta", 100, 200, 7, 8, 16, 4)]
    assert streams == [5]  # the key's device's current stream
    none = key._replace(aligned=0)
    triton_launch._keep(none, Kernel, None, (5,), 2, (7, 8), {"ITERS": 4, "BLOCK": 16})
    assert none not in triton_launch._compiled  # Triton launched nothing it returned
