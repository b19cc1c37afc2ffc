"""Every bad input raises a clear error that names the argument, the value and what was expected."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import rope_dispatch as rd

SBHD = dict(layout="sbhd", dtype="fp32")


def call(t=None, freqs=None, spec=None, **kw):
    t = torch.randn(8, 2, 3, 16) if t is None else t
    freqs = torch.rand(8, 1, 1, 16) if freqs is None else freqs
    spec = rd.RoPESpec(**SBHD) if spec is None else spec
    return rd.apply(t, freqs, spec, **kw)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(layout="hsbd", dtype="fp32"), ["layout", "hsbd"]),
        (dict(layout="sbhd", dtype="int8"), ["dtype", "int8"]),
        (dict(layout="sbhd", dtype=torch.float64), ["float64", "not supported"]),
        (dict(layout="sbhd", dtype=3), ["dtype", "3"]),
        (dict(layout="sbhd", dtype="fp32", rotary_dim=7), ["rotary_dim", "7", "even"]),
        (dict(layout="sbhd", dtype="fp32", rotary_dim=0), ["rotary_dim", "0"]),
        (dict(layout="sbhd", dtype="fp32", cp_size=0), ["cp_size", "0"]),
        (dict(layout="sbhd", dtype="fp32", cp_size=2, cp_rank=2), ["cp_rank", "2"]),
        (dict(layout="sbhd", dtype="fp32", cp_rank=-1), ["cp_rank", "-1"]),
        (dict(layout="sbhd", dtype="fp32", cu_seqlens=torch.tensor([0, 4])), ["cu_seqlens", "only", "thd"]),
        (dict(layout="sbhd", dtype="fp32", max_seqlen=4), ["max_seqlen", "thd"]),
        (dict(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0.0, 4.0])), ["cu_seqlens", "int32", "float32"]),
        (dict(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([[0, 4]])), ["cu_seqlens", "1-D", "(1, 2)"]),
        (dict(layout="thd", dtype="fp32", cu_seqlens=[0, 4]), ["cu_seqlens"]),
        (dict(layout="sbhd", dtype="fp32", colour="red"), ["colour"]),
        # what pydantic alone would convert: numbers in strings, floats and bools for integers
        (dict(layout="sbhd", dtype="fp32", cp_size=2.0, cp_rank=0), ["cp_size", "2.0", "integer"]),
        (dict(layout="sbhd", dtype="fp32", rotary_dim="16"), ["rotary_dim", "'16'", "integer"]),
        (dict(layout="sbhd", dtype="fp32", cp_rank=True), ["cp_rank", "True", "integer"]),
        (dict(layout="thd", dtype="fp32", max_seqlen=8.0), ["max_seqlen", "8.0", "integer"]),
        (dict(layout="sbhd", dtype="fp32", cos_sin_scale="1.5"), ["cos_sin_scale", "'1.5'", "number"]),
        (dict(layout="sbhd", dtype="fp32", cos_sin_scale=True), ["cos_sin_scale", "True"]),
        # an int past float64's range: float() raised OverflowError, naming nothing
        (dict(layout="sbhd", dtype="fp32", cos_sin_scale=10**400), ["cos_sin_scale", "float32"]),
        (dict(layout="sbhd", dtype="fp32", interleaved="yes"), ["interleaved", "'yes'", "True or False"]),
        (dict(layout="sbhd", dtype="fp32", interleaved=1), ["interleaved", "1", "True or False"]),
        (dict(layout="sbhd", dtype="fp32", mrope_section=(16, 24.0, 24)), ["mrope_section", "24.0"]),
        (dict(layout="sbhd", dtype="fp32", mrope_section=(16, 24)), ["mrope_section", "three"]),
    ],
)
def test_bad_spec(fields, words):
    with pytest.raises(rd.RoPEError) as info:
        rd.RoPESpec(**fields)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("invalid RoPESpec: ")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("fields, words", [
    (dict(layout="sbhd", dtype="int8"), ["dtype", "int8"]),
    (dict(layout="sbhd", dtype="fp32", cp_size="2"), ["cp_size", "'2'", "integer"]),
    (dict(layout="sbhd", dtype="fp32", colour="red"), ["colour"]),
    (dict(layout="sbhd", dtype="fp32", cos_sin_scale=10**400), ["cos_sin_scale", "float32"]),
])
def test_bad_spec_from_a_config(fields, words):
    """model_validate, model_validate_json and model_validate_strings (a spec from a config)
    refuse as the constructor does, with a RoPEError (pydantic's ValidationError before), the
    prefix said once."""
    import json

    from_json = lambda f: rd.RoPESpec.model_validate_json(json.dumps(f))  # noqa: E731
    for make in (rd.RoPESpec.model_validate, from_json, rd.RoPESpec.model_validate_strings):
        with pytest.raises(rd.RoPEError) as info:
            make(fields)
        text = str(info.value)
        assert text.startswith("invalid RoPESpec: ") and text.count("invalid RoPESpec") == 1, text
        for word in words:
            assert word in text, (word, text)
    spec = rd.RoPESpec.model_validate(dict(layout="sbhd", dtype="fp32", rotary_dim=16))
    assert spec == rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=16)
    with pytest.raises(rd.RoPEError, match="^invalid RoPESpec: .*got 'sbhd'"):
        rd.RoPESpec.model_validate_strings("sbhd")


def test_spec_takes_numpy_numbers():
    """Sizes read from NumPy arrays or configs are NumPy scalars: taken as the numbers they are."""
    np = pytest.importorskip("numpy")
    spec = rd.RoPESpec(layout="thd", dtype="fp32", rotary_dim=np.int64(16), max_seqlen=np.int32(8),
                       cp_size=np.int64(2), cp_rank=np.int64(1), cos_sin_scale=np.float32(1.5),
                       interleaved=np.bool_(True))
    assert spec.static_key == rd.RoPESpec(
        layout="thd", dtype="fp32", rotary_dim=16, max_seqlen=8, cp_size=2, cp_rank=1,
        cos_sin_scale=1.5, interleaved=True,
    ).static_key
    assert type(spec.rotary_dim) is int and type(spec.cos_sin_scale) is float
    assert type(spec.interleaved) is bool
    multimodal = rd.RoPESpec(layout="sbhd", dtype="bf16", mrope_section=[np.int64(2), 3, 3])
    assert multimodal.mrope_section == (2, 3, 3)
    assert all(type(n) is int for n in multimodal.mrope_section)


def test_spec_refuses_a_bool_look_alike():
    """A bool field took any object whose class is named ``bool`` or ``bool_`` (meant for
    NumPy's) as its truth value: an object of another library's class so named turned
    interleaved on. Only Python's and NumPy's bools are taken."""
    look_alike = type("bool", (), {"__module__": "other"})()
    for field in ("interleaved", "inverse", "deinterleave"):
        with pytest.raises(rd.RoPEError, match=f"^invalid RoPESpec: {field}: expected True or "
                           "False, got <other.bool object"):
            rd.RoPESpec(layout="sbhd", dtype="fp32", **{field: look_alike})
    np = pytest.importorskip("numpy")
    assert rd.RoPESpec(layout="sbhd", dtype="fp32", inverse=np.bool_(True)).inverse is True


def test_spec_to_json_and_back():
    """A spec written as JSON (a config, a log) reads back as the same spec: its dtype as its
    name; cu_seqlens as numbers, which a spec takes back only as a tensor."""
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.bfloat16, rotary_dim=16, cos_sin_scale=0.5,
                       mrope_section=(2, 3, 3), rotary_offset=4, inverse=True)
    assert rd.RoPESpec.model_validate_json(spec.model_copy(update=dict(
        mrope_section=None, cp_size=2, cp_rank=1, interleaved=True)).model_dump_json()).cp_rank == 1
    text = spec.model_dump_json()
    assert '"dtype":"bfloat16"' in text
    back = rd.RoPESpec.model_validate_json(text)
    assert back == spec and back.static_key == spec.static_key and back.dtype is torch.bfloat16
    packed = rd.RoPESpec(layout="thd", dtype="fp16").with_cu_seqlens(
        torch.tensor([0, 3, 5], dtype=torch.int32), max_seqlen=3)
    text = packed.model_dump_json()
    assert '"cu_seqlens":[0,3,5]' in text and '"max_seqlen":3' in text
    with pytest.raises(rd.RoPEError, match="cu_seqlens"):
        rd.RoPESpec.model_validate_json(text)


def test_spec_json_schema_describes_what_json_holds():
    """model_json_schema (config tools, API docs) raised PydanticInvalidForJsonSchema for the
    torch.dtype and the tensor field; it describes the dtype's name and cu_seqlens as JSON
    holds them (numbers written, none read back)."""
    import json

    read, written = (rd.RoPESpec.model_json_schema(mode=mode)
                     for mode in ("validation", "serialization"))
    assert list(read["properties"]) == list(rd.RoPESpec.model_fields) == list(
        written["properties"])
    assert read["properties"]["dtype"]["type"] == "string" == written["properties"]["dtype"]["type"]
    assert read["properties"]["cu_seqlens"]["type"] == "null"
    packed = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=torch.tensor([0, 3, 5]))
    values = json.loads(packed.model_dump_json())
    assert isinstance(values["dtype"], str) and values["cu_seqlens"] == [0, 3, 5]
    assert {"type": "array", "items": {"type": "integer"}} in (
        written["properties"]["cu_seqlens"]["anyOf"])


def test_spec_is_frozen_and_hashable():
    spec = rd.RoPESpec(layout="bshd", dtype="bfloat16", rotary_dim=64)
    with pytest.raises(ValidationError):
        spec.layout = "sbhd"
    assert spec.dtype is torch.bfloat16
    assert spec.static_key == rd.RoPESpec(layout="bshd", dtype=torch.bfloat16, rotary_dim=64).static_key
    assert {spec: 1}[spec] == 1


@pytest.mark.filterwarnings("ignore:The `copy` method is deprecated")
def test_pydantics_deprecated_copy_validates_the_copy():
    """pydantic's deprecated ``copy(update=...)`` skipped validation and kept the original's
    static_key: the copy took rotary_dim=3, and an interleaved copy read as the original."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=16)
    changed = spec.copy(update={"interleaved": True})
    assert changed == rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=16, interleaved=True)
    assert changed.static_key != spec.static_key and "interleaved=True" in repr(changed)
    with pytest.raises(rd.RoPEError, match="rotary_dim must be a positive even integer, got 3"):
        spec.copy(update={"rotary_dim": 3})
    assert spec.copy() == spec and spec.copy(exclude={"rotary_dim"}).rotary_dim is None


@pytest.mark.filterwarnings("ignore:The `copy` method is deprecated")
def test_pydantics_deprecated_copy_refuses_a_misspelled_update():
    """``copy(update=...)`` dropped a name that is no field (a misspelling, or static_key)
    without a word, returning the spec unchanged; model_copy refuses it, and now copy too."""
    spec = rd.RoPESpec(layout="thd", dtype="fp32", rotary_dim=16)
    for name in ("rotary_dimm", "static_key"):
        with pytest.raises(rd.RoPEError, match=f"^invalid RoPESpec: {name}: Extra inputs are "
                           "not permitted"):
            spec.copy(update={name: 64})
    cu = torch.tensor([0, 3, 5])
    deep = spec.copy(update={"cu_seqlens": cu, "rotary_dim": 8}, deep=True)
    assert deep.rotary_dim == 8 and deep.cu_seqlens is not cu
    assert torch.equal(deep.cu_seqlens, cu)
    assert spec.copy(update={"cu_seqlens": cu}).cu_seqlens is cu


def test_a_spec_iterates_over_its_fields():
    """``dict(spec)`` (pydantic's iteration) gives the fields, which make the same spec again;
    it gave static_key and its texts too, which the constructor refuses as extra inputs."""
    packed = rd.RoPESpec(layout="thd", dtype="fp16", cu_seqlens=torch.tensor([0, 3, 5]),
                         max_seqlen=3, cos_sin_scale=0.5, rotary_offset=2)
    for spec in (packed, rd.RoPESpec(layout="sbhd", dtype="bf16", mrope_section=(2, 3, 3))):
        fields = dict(spec)
        assert list(fields) == list(rd.RoPESpec.model_fields)
        assert fields == spec.model_dump()
        assert rd.RoPESpec(**fields) == spec


def test_spec_model_construct_validates_as_the_constructor():
    """pydantic's model_construct skips validation: its spec had no static_key, so every call
    with it raised AttributeError. It is validated as a new spec, as model_copy's copies are."""
    from reference import assert_matches, reference_for

    spec = rd.RoPESpec.model_construct(layout="sbhd", dtype="fp32", rotary_dim=16, inverse=True)
    assert spec == rd.RoPESpec(layout="sbhd", dtype=torch.float32, rotary_dim=16, inverse=True)
    assert spec.dtype is torch.float32
    t, freqs = torch.randn(8, 2, 3, 16), torch.rand(8, 1, 1, 16) * 6
    assert_matches(rd.apply(t, freqs, spec, backend="eager"), reference_for(t, freqs, spec),
                   torch.float32)
    with pytest.raises(rd.RoPEError, match="rotary_dim must be a positive even integer, got 3"):
        rd.RoPESpec.model_construct(layout="sbhd", dtype="fp32", rotary_dim=3)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(t=torch.randn(8, 2, 3, 16).half()), ["t has dtype float16", "spec.dtype is float32"]),
        (dict(t=torch.randint(0, 5, (8, 2, 3, 16))), ["int64", "float32"]),
        (dict(t=torch.randn(8, 3, 16)), ["4 dims", "sbhd", "(8, 3, 16)"]),
        (dict(freqs=torch.rand(8, 1, 1, 15)), ["even", "(8, 15)"]),
        (dict(freqs=torch.rand(8, 1, 1, 32)), ["d2=32", "head dim d=16"]),
        (dict(freqs=torch.rand(5, 1, 1, 16)), ["5 positions", "needs 8", ">= 8"]),
        (dict(freqs=torch.rand(8, 2, 1, 16)), ["[s2, 1, 1, d2]", "(8, 2, 1, 16)"]),
        (dict(freqs=torch.rand(8, 16).double()), ["float32", "float64"]),
        (dict(freqs=torch.rand(8, 16).bfloat16()), ["float32", "bfloat16"]),
        (dict(freqs=torch.rand(8)), ["freqs", "(8,)"]),
        (dict(spec=rd.RoPESpec(**SBHD, rotary_dim=8)), ["rotary_dim=8", "d2=16"]),
        (dict(spec=rd.RoPESpec(**SBHD, cp_size=2, cp_rank=1)), ["needs 16", "cp_size=2"]),
        (dict(t=torch.randn(7, 2, 3, 16), spec=rd.RoPESpec(**SBHD, cp_size=2)), ["even", "7"]),
        (dict(start_positions=torch.tensor([0, 1, 2])), ["start_positions", "[2]", "(3,)"]),
        (dict(start_positions=torch.tensor([0.0, 1.0])), ["start_positions", "int32", "float32"]),
        (dict(start_positions=torch.tensor([0, -1])), ["start_positions", ">= 0", "-1"]),
        (dict(start_positions=torch.tensor([0, 1])), ["start_positions max 1", "needs 9"]),
        (dict(start_positions=[0, 1]), ["start_positions", "list"]),
        (dict(spec=rd.RoPESpec(**SBHD, cp_size=2), freqs=torch.rand(16, 16), start_positions=torch.tensor([0, 1])),
         ["16 positions", "start_positions max 1", "sequence length 8 x cp_size=2", "needs 17"]),
        (dict(backend="nope"), ["unknown backend 'nope'", "(forced by the backend= argument)",
                                "eager"]),
        (dict(backend="Eager "), ["unknown backend 'Eager '", "did you mean 'eager'?"]),
        (dict(backend=["eager"]), ["unknown backend ['eager']", "known backends"]),
        (dict(t=[1.0]), ["t must be a torch.Tensor", "list"]),
        (dict(freqs="angles"), ["freqs", "str"]),
        (dict(spec={"layout": "sbhd"}), ["spec must be", "dict"]),
    ],
)
def test_bad_call(kwargs, words):
    with pytest.raises((rd.RoPEError, TypeError)) as info:
        call(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_pair_and_packed_calls_name_their_tensor():
    """apply_qk's and rope_to_cache's first tensor is q and apply_qkv's qkv: their errors say
    so (they said t, apply's name)."""
    spec, freqs = rd.RoPESpec(**SBHD), torch.rand(8, 16)
    with pytest.raises(rd.RoPEError, match="q has dtype float16 but spec.dtype is float32"):
        rd.apply_qk(torch.randn(8, 2, 3, 16).half(), torch.randn(8, 2, 1, 16), freqs, spec)
    with pytest.raises(rd.RoPEError, match="qkv must have 4 dims"):
        rd.apply_qkv(torch.randn(8, 2, 48), freqs, spec, (16, 16, 16))
    with pytest.raises(rd.RoPEError, match="head dim d=8 of q"):
        rd.apply_qk_(torch.randn(8, 2, 3, 8), torch.randn(8, 2, 1, 8), freqs, spec)
    cache = rd.FlatKVCache(torch.zeros(4, 1, 16), torch.zeros(4, 1, 16), torch.tensor([0, 1]))
    with pytest.raises(rd.RoPEError, match="q has dtype float16"):
        rd.rope_to_cache(torch.randn(2, 2, 16).half(), torch.randn(2, 1, 16),
                         torch.randn(2, 1, 16), freqs, rd.RoPESpec(layout="thd", dtype="fp32"),
                         positions=torch.tensor([0, 1]), cache=cache)


THD_T = torch.randn(10, 2, 8)


@pytest.mark.parametrize(
    "cu, kw, words",
    [
        ([0, 6, 4, 10], {}, ["non-decreasing", "cu_seqlens[2]=4", "cu_seqlens[1]=6"]),
        ([1, 6, 10], {}, ["start at 0", "1"]),
        ([0, 6, 12], {}, ["cu_seqlens[-1]=12", "t.shape[0]=10"]),
        ([0, 6, 10], dict(max_seqlen=5), ["max_seqlen=5", "length 6"]),
        ([0, 0, 10], dict(max_seqlen=0), ["max_seqlen=0", "length 10"]),
        ([0, 10, 20], dict(cp_size=2), ["divisible by 2*cp_size=4", "length 10"]),
        ([0, 3, 10], dict(freqs_len=6), ["6 positions", "up to 6", ">= 7"]),
    ],
)
def test_bad_cu_seqlens(cu, kw, words):
    freqs_len = kw.pop("freqs_len", 16)
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor(cu), **kw)
    with pytest.raises(rd.RoPEError) as info:
        rd.apply(THD_T, torch.rand(freqs_len, 8), spec)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_thd_needs_offsets_or_positions():
    """A thd spec may leave cu_seqlens out (token batches with per-token positions); a call
    that gives neither is refused."""
    spec = rd.RoPESpec(layout="thd", dtype="fp32")
    with pytest.raises(rd.RoPEError, match="needs cu_seqlens in the spec .* or per-token positions"):
        rd.apply(THD_T, torch.rand(16, 8), spec)
    out = rd.apply(THD_T, torch.rand(16, 8), spec, positions=torch.arange(10))
    assert out.shape == THD_T.shape


@pytest.mark.parametrize(
    "layout, shape, positions, kw, words",
    [
        ("sbhd", (4, 2, 3, 8), torch.zeros(2, 4, dtype=torch.long), {}, ["[s, b] = [4, 2]", "(2, 4)"]),
        ("bshd", (2, 4, 3, 8), torch.zeros(4, 2, dtype=torch.long), {}, ["[b, s] = [2, 4]", "(4, 2)"]),
        ("thd", (6, 3, 8), torch.zeros(6, 1, dtype=torch.long), {}, ["[T] = [6]", "(6, 1)"]),
        ("sbhd", (4, 2, 3, 8), torch.zeros(4, 2), {}, ["positions must be int32 or int64", "float32"]),
        ("sbhd", (4, 2, 3, 8), torch.tensor([[0, 1]] * 3 + [[15, 16]]), {}, ["[0, 16)", "0 to 16"]),
        ("sbhd", (4, 2, 3, 8), torch.tensor([[0, -1]] * 4), {}, ["[0, 16)", "-1 to 0"]),
        ("sbhd", (4, 2, 3, 8), torch.zeros(4, 2, dtype=torch.long),
         dict(start_positions=torch.tensor([0, 1])), ["positions and start_positions cannot be combined"]),
        ("sbhd", (4, 2, 3, 8), torch.zeros(4, 2, dtype=torch.long), dict(cp_size=2),
         ["positions cannot be combined with context parallelism", "cp_size=2"]),
        ("sbhd", (4, 2, 3, 8), [[0, 1]], {}, ["positions must be an int tensor", "list"]),
    ],
)
def test_bad_positions(layout, shape, positions, kw, words):
    starts = kw.pop("start_positions", None)
    spec = rd.RoPESpec(layout=layout, dtype="fp32", **kw)
    with pytest.raises((rd.RoPEError, TypeError)) as info:
        rd.apply(torch.randn(shape), torch.rand(16, 8), spec, positions=positions, start_positions=starts)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_thd_start_positions_past_table():
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(rd.RoPEError, match="up to 16"):
        rd.apply(THD_T, torch.rand(16, 8), spec, start_positions=torch.tensor([0, 11]))
    rd.apply(THD_T, torch.rand(17, 8), spec, start_positions=torch.tensor([0, 11]))


def test_thd_empty_sequence_may_start_past_the_table():
    """An empty sequence reads no row, so its start may lie past the table (TE takes it; a
    finished slot of a packed serving batch keeps its large start)."""
    from reference import reference_forward_backward

    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 4, 4, 10]))
    table = torch.rand(16, 8)
    starts = torch.tensor([0, 100, 5])
    got = rd.apply(THD_T, table, spec, start_positions=starts, backend="eager")
    want, _ = reference_forward_backward(THD_T, table, spec, torch.zeros(THD_T.shape), starts)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    with pytest.raises(rd.RoPEError, match="up to 16"):
        rd.apply(THD_T, table, spec, start_positions=torch.tensor([0, 100, 11]))
    none = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 0, 0]))
    assert rd.apply(THD_T[:0], table, none, start_positions=torch.tensor([3, 90])).shape == (0, 2, 8)


def test_thd_start_positions_past_table_with_trusted_offsets(monkeypatch):
    """With max_seqlen given (device offsets are then not read), a table too short for
    max_seqlen plus the largest start position is still refused."""
    from rope_dispatch import call as call_module

    monkeypatch.setattr(call_module, "reads_values", lambda spec: False)  # as on a GPU
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 4, 10]), max_seqlen=6)
    with pytest.raises(rd.RoPEError, match="max_seqlen=6 \\+ start_positions max 11 needs 17"):
        rd.apply(THD_T, torch.rand(16, 8), spec, start_positions=torch.tensor([0, 11]))
    rd.apply(THD_T, torch.rand(17, 8), spec, start_positions=torch.tensor([0, 11]))


@pytest.mark.parametrize(
    "cos, sin, words",
    [
        (torch.rand(8, 16).double(), torch.rand(8, 16), ["float64"]),
        (torch.rand(8, 5), torch.rand(8, 5), ["even d2 >= 2", "cos (8, 5) float32"]),
        (torch.rand(8, 0), torch.rand(8, 0), ["even d2 >= 2", "cos (8, 0)"]),
        (torch.rand(0, 16), torch.rand(0, 16), ["at least one position", "cos (0, 16)"]),
        ([1.0], [2.0], ["CosSinCache of list cos and list sin", "two [s2, d2] tensors"]),
        (torch.rand(8, 16), None, ["CosSinCache of Tensor cos and NoneType sin"]),
    ],
)
def test_bad_cache_object(cos, sin, words):
    """A cos/sin cache the kernels cannot read as pairs is refused with what it holds, never
    run (an odd d2 used to rotate channel pairs across its end on the Triton backend)."""
    with pytest.raises(rd.RoPEError, match="CosSinCache") as info:
        call(freqs=rd.CosSinCache(cos, sin))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_with_cu_seqlens_checks_tensor():
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(rd.RoPEError, match="int32 or int64"):
        spec.with_cu_seqlens(torch.tensor([0.0, 10.0]))
    with pytest.raises(rd.RoPEError, match="needs layout 'thd'"):
        rd.RoPESpec(**SBHD).with_cu_seqlens(torch.tensor([0, 10]))
    new = spec.with_cu_seqlens(torch.tensor([0, 4, 10]), max_seqlen=6)
    assert new.max_seqlen == 6 and new.cu_seqlens.tolist() == [0, 4, 10]
    for bad in ("6", 6.0, True):  # refused by name, as the field refuses them (a str was a
        with pytest.raises(rd.RoPEError, match=f"max_seqlen: expected an integer, got {bad!r}"):
            spec.with_cu_seqlens(torch.tensor([0, 4, 10]), max_seqlen=bad)  # bare TypeError)
    assert rd.apply(THD_T, torch.rand(6, 8), new).shape == THD_T.shape
    with pytest.raises(rd.RoPEError, match="max_seqlen must be >= 0, got -1"):
        spec.with_cu_seqlens(torch.tensor([0, 10]), max_seqlen=-1)


def test_a_batch_of_no_tokens_takes_max_seqlen_0():
    """A caller's max(lengths) of a batch whose sequences are all empty: nothing to rotate."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    empty = torch.tensor([0, 0, 0], dtype=torch.int32, device=device)
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=empty, max_seqlen=0)
    for backend in ("eager", "triton"):
        if not rd.get_backend(backend).available:
            continue
        out = rd.apply(torch.randn(0, 2, 8, device=device), torch.rand(4, 8, device=device),
                       spec, backend=backend)
        assert out.shape == (0, 2, 8)
    again = spec.with_cu_seqlens(empty, max_seqlen=0)
    assert again.max_seqlen == 0


def test_errors_are_value_errors():
    assert issubclass(rd.RoPEError, ValueError)
    assert issubclass(rd.NoBackendError, rd.RoPEError)
    assert issubclass(rd.BackendNotSupportedError, rd.RoPEError)


# --- one error type: every error a user can cause is a RoPEError, checked where it is made ----


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: call(start_positions=[0, 1]), ["start_positions", "int tensor", "list"]),
        (lambda: call(positions=[0, 1]), ["positions", "int tensor", "list"]),
        (lambda: rd.apply(torch.randn(8, 2, 3, 16), torch.rand(8, 1, 1, 16), "sbhd"),
         ["spec", "RoPESpec", "str"]),
        (lambda: call(freqs=torch.rand(8, 1, 1, 16).numpy()), ["freqs", "float32 torch.Tensor", "ndarray"]),
        (lambda: call(t=torch.randn(8, 2, 3, 16).numpy()), ["t must be a torch.Tensor", "ndarray"]),
        (lambda: rd.cos_sin_cache(torch.rand(8, 16).numpy()), ["freqs", "ndarray"]),
        (lambda: rd.cos_sin_cache(rd.RateTable(torch.ones(8), 4)),
         ["cos_sin_cache takes an angle table", "got a RateTable", "rates.angle_table("]),
        (lambda: rd.cos_sin_cache(rd.cos_sin_cache(torch.rand(8, 16))),
         ["cos_sin_cache takes an angle table", "got a CosSinCache", "pass it as freqs as it is"]),
        (lambda: rd.cos_sin_cache(rd.PairCosSinCache(torch.rand(8, 16))),
         ["got a PairCosSinCache", "pass it as freqs as it is"]),
        (lambda: rd.apply_qk(torch.randn(8, 2, 3, 16), [1.0], torch.rand(8, 16), rd.RoPESpec(**SBHD)),
         ["k must be a torch.Tensor", "list"]),
        (lambda: rd.apply_qk(torch.randn(8, 2, 3, 16), None, torch.rand(8, 16), rd.RoPESpec(**SBHD)),
         ["k must be a torch.Tensor", "None", "rope_dispatch.apply for q alone"]),
        (lambda: rd.apply_qk_(torch.randn(8, 2, 3, 16), None, torch.rand(8, 16), rd.RoPESpec(**SBHD)),
         ["k must be a torch.Tensor", "None", "rope_dispatch.apply_ for q alone"]),
        (lambda: rd.CosSinCache([1.0], [2.0]), ["CosSinCache of list cos and list sin", "two [s2, d2] tensors"]),
        (lambda: rd.PairCosSinCache([[1.0, 0.0]]), ["PairCosSinCache's table", "float32 tensor", "list"]),
    ],
)
def test_wrong_types_are_rope_errors_and_type_errors(make, words):
    """A wrong type is a RoPETypeError: a RoPEError (one type to catch) and a TypeError, as
    these were before."""
    with pytest.raises(rd.RoPETypeError) as info:
        make()
    assert isinstance(info.value, rd.RoPEError) and isinstance(info.value, TypeError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: rd.CosSinCache(torch.randn(32, 64), torch.randn(16, 64)),
         ["same shape", "cos (32, 64) float32", "sin (16, 64) float32"]),
        (lambda: rd.CosSinCache(torch.randn(8, 64), torch.randn(8, 64).half()),
         ["one dtype", "float32", "float16"]),
        (lambda: rd.CosSinCache(torch.randn(8, 5), torch.randn(8, 5)), ["even d2 >= 2", "cos (8, 5)"]),
        (lambda: rd.CosSinCache(torch.randn(0, 4), torch.randn(0, 4)), ["at least one position", "(0, 4)"]),
        (lambda: rd.CosSinCache(torch.randn(8, 1, 1, 4), torch.randn(8, 1, 1, 4)),
         ["[s2, d2]", "(8, 1, 1, 4)"]),
        (lambda: rd.CosSinCache(torch.randn(4, 8)[:, :4], torch.randn(4, 4)),
         ["contiguous", "(8, 1)"]),
        (lambda: rd.PairCosSinCache(torch.randn(32, 63)), ["PairCosSinCache", "even d2", "(32, 63)"]),
        (lambda: rd.PairCosSinCache(torch.randn(32, 64).double()), ["PairCosSinCache", "float32", "float64"]),
        (lambda: rd.PairCosSinCache(torch.randn(64, 32).t()), ["PairCosSinCache", "contiguous"]),
    ],
)
def test_tables_check_themselves_when_built(make, words):
    """A cache the kernels could not read is refused when it is built, each condition in its
    own words with the values, not at a later apply with one sentence for all."""
    with pytest.raises(rd.RoPEError) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


class _LlamaLikeConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    head_dim = 16
    max_position_embeddings = 64


def test_rotary_frequencies_passed_as_freqs_says_what_to_call():
    f = rd.tables.from_hf_config(_LlamaLikeConfig(), 64)
    with pytest.raises(rd.RoPETypeError) as info:
        call(freqs=f)
    message = str(info.value)
    for word in ("freqs is a RotaryFrequencies", "cos_sin_cache(", "angle_table(", "rate_table("):
        assert word in message, (word, message)
    # what it says to call works
    t = torch.randn(8, 2, 3, 16)
    out = call(t=t, freqs=f.cos_sin_cache(8, device=t.device))
    assert torch.allclose(out, call(t=t, freqs=f.angle_table(8)), atol=1e-5)


def test_a_bad_hot_calls_setting_names_the_variable(monkeypatch):
    from rope_dispatch import autotune

    monkeypatch.setenv("ROPE_AUTOTUNE_HOT_CALLS", "soon")
    with pytest.raises(rd.RoPEError, match="ROPE_AUTOTUNE_HOT_CALLS.*positive integer.*'soon'"):
        autotune.hot_calls()


@pytest.mark.parametrize("value", ["Eager ", "nope", "eager,triton"])
@pytest.mark.parametrize("entry", ["apply", "explain"])
def test_an_unknown_rope_backend_names_the_variable(monkeypatch, value, entry):
    """An unknown ROPE_BACKEND is refused naming the variable and its value, as a known one
    that cannot serve is; a near miss says what it may have meant."""
    monkeypatch.setenv("ROPE_BACKEND", value)
    run = rd.apply if entry == "apply" else rd.explain
    with pytest.raises(rd.UnknownBackendError) as info:
        run(torch.randn(4, 1, 2, 8), torch.rand(4, 8), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    message = str(info.value)
    assert f"unknown backend {value!r}" in message and "ROPE_BACKEND" in message, message
    assert ("did you mean 'eager'?" in message) == (value == "Eager "), message


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_explain_refuses_an_in_place_that_is_not_a_bool(value):
    """explain(in_place=...) is refused by name, not read as truthy: "yes" explained an
    in-place call, 0 and None an out-of-place one, whatever was meant."""
    with pytest.raises(rd.RoPETypeError, match=f"in_place must be True or False, got {value!r}"):
        rd.explain(torch.randn(4, 1, 2, 8), torch.rand(4, 8),
                   rd.RoPESpec(layout="sbhd", dtype="fp32"), in_place=value)


@pytest.mark.parametrize("entry", ["apply_", "apply_qk_"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_grad_in_place_that_is_not_a_bool_is_refused(entry, value):
    """grad_in_place lets a backward overwrite the incoming gradient: a truthy "no" must not
    switch that on, nor a falsy None stand for False; both are refused by name, also where
    calls with grad_in_place=True and False were planned (1 == True as a plan's key)."""
    spec, freqs = rd.RoPESpec(layout="sbhd", dtype="fp32"), torch.rand(4, 8)
    q, k = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)
    args = (q, freqs, spec) if entry == "apply_" else (q, k, freqs, spec)
    for planned in (True, True, False, False):
        getattr(rd, entry)(*args, grad_in_place=planned)
    named = f"grad_in_place must be True or False, got {value!r}"
    with pytest.raises(rd.RoPETypeError, match=named):
        getattr(rd, entry)(*args, grad_in_place=value)
