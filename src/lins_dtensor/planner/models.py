"""Model descriptions the planner can cost: LLaMA-style decoder shapes, grouped into units.

A model comes from a preset, torchtitan's registry (``llama3:8B``), a Hugging Face
``config.json``, explicit shape numbers (:func:`decoder_spec`) or an ``nn.Module``.

The planner does not derive byte counts itself: it hands each unit's parameter shapes
to :mod:`lins_dtensor.schedule`, so the units here must be grouped the way the runtime
groups them (``lins_dtensor.runtime.default_units``: the token embedding, one unit per
transformer block, the final norm, the output projection). The architecture numbers
(layers, hidden size, heads, vocabulary) feed the activation and FLOP models.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from lins_dtensor.errors import PlannerError
from lins_dtensor.runtime import default_units

Shape = tuple[int, ...]


def read_json(path: str | Path, what: str) -> object:
    """A JSON file the planner was pointed at; a missing or broken one is one line naming it."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlannerError(f"cannot read {what} '{path}': {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{what} '{path}' is not JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError as exc:
        raise PlannerError(f"{what} '{path}' is not JSON: {exc.reason}") from None


def llama_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU hidden size by the LLaMA rule: 2/3 of 4*dim, scaled, rounded up."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A LLaMA-style decoder: what the planner needs to cost memory, bytes and FLOPs.

    ``units`` (optional) are explicit parameter shapes per FSDP unit, e.g. read from an
    ``nn.Module``; when absent they are built from the architecture numbers.
    ``embedding_params`` are excluded from the 6*N FLOP count (a lookup, not a matmul).
    ``tied_embeddings``: the output projection reuses the embedding table, so there is
    no output unit and the table counts as matmul parameters.
    """

    name: str
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int
    n_kv_heads: int | None = None
    units: tuple[tuple[Shape, ...], ...] | None = None
    embedding_params: int | None = None
    tied_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def block_shapes(self) -> tuple[Shape, ...]:
        """One transformer block, in the block's parameter order (nn.Linear is (out, in))."""
        d, kv, f = self.dim, self.kv_heads * self.head_dim, self.ffn_dim
        return ((d, d), (kv, d), (kv, d), (d, d), (f, d), (d, f), (f, d), (d,), (d,))

    def unit_shapes(self) -> list[tuple[Shape, ...]]:
        """Parameter shapes of every unit, in the order the runtime shards them."""
        if self.units is not None:
            return [tuple(tuple(s) for s in unit) for unit in self.units]
        d, v = self.dim, self.vocab_size
        output = [] if self.tied_embeddings else [((v, d),)]
        return [((v, d),), *[self.block_shapes()] * self.n_layers, ((d,),), *output]

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for unit in self.unit_shapes() for s in unit)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (all but an untied embedding table)."""
        if self.tied_embeddings:
            return self.num_params
        embedding = self.vocab_size * self.dim if self.embedding_params is None else self.embedding_params
        return self.num_params - embedding


def tensor_parallel_local(model: ModelSpec, tp: int) -> ModelSpec:
    """The parameter shapes one of ``tp`` tensor-parallel ranks holds under torchtitan's
    LLaMA plan: wq, wk, wv, w1, w3 and the output projection split by rows (colwise),
    the embedding by vocabulary rows, wo and w2 by columns (rowwise), norms replicated."""
    if tp == 1:
        return model
    if model.units is not None:
        raise PlannerError(f"{model.name}: tp={tp} needs the model's architecture numbers, not explicit unit shapes")
    for key, value in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads), ("ffn_dim", model.ffn_dim), ("vocab_size", model.vocab_size)):
        if value % tp:
            raise PlannerError(f"{model.name}: tp={tp} must divide {key}={value}")
    d, kv, f, v = model.dim, model.kv_heads * model.head_dim, model.ffn_dim, model.vocab_size
    block = ((d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp), (f // tp, d), (d, f // tp), (f // tp, d), (d,), (d,))
    output = [] if model.tied_embeddings else [((v // tp, d),)]
    units = (((v // tp, d),), *[block] * model.n_layers, ((d,),), *output)
    return dataclasses.replace(model, units=units, embedding_params=(v // tp) * d)


# A LLaMA block multiplies by its weights in this order (indices into
# ModelSpec.block_shapes(), which is parameter order): wq, wk, wv, then wo after
# attention, then w1 and w3 whose SwiGLU product feeds w2.
_FORWARD_ORDER = (0, 1, 2, 3, 4, 6, 5)


def block_matmuls(model: ModelSpec, tp: int = 1) -> tuple[Shape, ...]:
    """The (out, in) weights one of ``tp`` ranks multiplies by in one block's forward, in
    the order it does (what activation checkpointing policies count); for explicit unit
    shapes (read from a module), the first block unit's matrices in parameter order."""
    if model.units is not None:
        return tuple(s for s in model.unit_shapes()[1] if len(s) == 2) if model.n_layers else ()
    block = tensor_parallel_local(model, tp).unit_shapes()[1]
    return tuple(block[i] for i in _FORWARD_ORDER)


def architecture_only(model: ModelSpec) -> ModelSpec:
    """``model`` described by its architecture numbers alone, which is what
    :func:`tensor_parallel_local` splits; a PlannerError if the explicit unit shapes
    (read from a module) are not the LLaMA layout those numbers give."""
    if model.units is None:
        return model
    plain = dataclasses.replace(model, units=None, embedding_params=None)
    if [sorted(unit) for unit in plain.unit_shapes()] != [sorted(tuple(s) for s in unit) for unit in model.units]:
        raise PlannerError(
            f"{model.name}: its parameter shapes are not the LLaMA layout of dim={model.dim}, n_layers={model.n_layers}, "
            f"n_heads={model.n_heads}, ffn_dim={model.ffn_dim}: the planner cannot split them for tensor parallelism"
        )
    return plain


def _check_positive(where: str, key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlannerError(f"{where}: {key} must be a positive integer, got {value!r}")


def decoder_spec(
    name: str, *, dim: int, n_layers: int, n_heads: int, vocab_size: int, ffn_dim: int,
    n_kv_heads: int | None = None, tied_embeddings: bool = False,
) -> ModelSpec:
    """A checked ModelSpec from architecture numbers. ``n_kv_heads`` equal to ``n_heads``
    is stored as None, so one shape has one ModelSpec however it was described."""
    numbers = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "vocab_size": vocab_size, "ffn_dim": ffn_dim, "n_kv_heads": n_kv_heads}
    for key, value in numbers.items():
        if value is not None:
            _check_positive(name, key, value)
    if dim % n_heads:
        raise PlannerError(f"{name}: dim={dim} is not divisible by n_heads={n_heads}")
    kv = n_heads if n_kv_heads is None else n_kv_heads
    if n_heads % kv:
        raise PlannerError(f"{name}: n_heads={n_heads} is not divisible by n_kv_heads={kv}")
    return ModelSpec(name, dim, n_layers, n_heads, vocab_size, ffn_dim, None if kv == n_heads else kv, tied_embeddings=tied_embeddings)


def _llama3(
    name: str, dim: int, n_layers: int, n_heads: int, vocab_size: int, n_kv_heads: int | None, multiple_of: int,
    ffn_dim_multiplier: float | None,
) -> ModelSpec:
    """A LLaMA-3 shape in torchtitan's terms (the presets and torchtitan's registry)."""
    ffn_dim = llama_ffn_dim(dim, multiple_of, ffn_dim_multiplier)
    return decoder_spec(name, dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size, ffn_dim=ffn_dim, n_kv_heads=n_kv_heads)


# torchtitan 0.2.2 llama3 flavors (vocab 128256 is TransformerModelArgs' default) and the
# LLaMA-1 shapes the Lins paper trains.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "debugmodel": _llama3("debugmodel", 256, 6, 16, 2048, None, 256, None),
    "llama3_8b": _llama3("llama3_8b", 4096, 32, 32, 128256, 8, 1024, 1.3),
    "llama3_70b": _llama3("llama3_70b", 8192, 80, 64, 128256, 8, 4096, 1.3),
    "llama3_405b": _llama3("llama3_405b", 16384, 126, 128, 128256, 8, 4096, 1.2),
    "llama_7b": ModelSpec("llama_7b", 4096, 32, 32, 32000, 11008),
    "llama_13b": ModelSpec("llama_13b", 5120, 40, 40, 32000, 13824),
    "llama_30b": ModelSpec("llama_30b", 6656, 60, 52, 32000, 17920),
}
_ALIASES = {"llama7b": "llama_7b", "llama13b": "llama_13b", "llama30b": "llama_30b", "8b": "llama3_8b", "70b": "llama3_70b", "405b": "llama3_405b"}


def model_preset(name: str) -> ModelSpec:
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in MODEL_PRESETS:
        raise PlannerError(
            f"unknown model preset '{name}'; known: {', '.join(MODEL_PRESETS)}; "
            "or a torchtitan model:flavor (llama3:8B), a Hugging Face config.json path, or custom with shape flags"
        )
    return MODEL_PRESETS[key]


_LLAMA_ARGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier")


def model_from_llama_args(name: str, args) -> ModelSpec:
    """A ModelSpec from torchtitan-style LLaMA model args (``TransformerModelArgs``)."""
    missing = next((key for key in _LLAMA_ARGS if not hasattr(args, key)), None)
    if missing is not None:
        raise PlannerError(f"{name}: model args have no '{missing}'; the planner costs dense LLaMA-style decoders")
    if hasattr(args, "moe_args"):
        raise PlannerError(f"{name} is a mixture-of-experts model; the planner costs dense LLaMA-style decoders")
    return _llama3(name, **{key: getattr(args, key) for key in _LLAMA_ARGS})


def model_from_torchtitan(text: str) -> ModelSpec:
    """``model:flavor`` from torchtitan's registry, e.g. ``llama3:70B``.

    torchtitan is an optional dependency, so it is imported here, not with the planner.
    """
    model, _, flavor = text.partition(":")
    try:
        from torchtitan.protocols.train_spec import get_train_spec
    except ImportError as exc:
        raise PlannerError(f"'{text}' names a torchtitan model but torchtitan is not importable ({exc}); install lins_dtensor[torchtitan]") from None
    try:
        flavors = get_train_spec(model).model_args
    except (ImportError, ValueError) as exc:
        raise PlannerError(f"torchtitan model '{model}' is not available: {exc}") from None
    if flavor not in flavors:
        raise PlannerError(f"torchtitan's {model} has no flavor '{flavor}'; known: {', '.join(flavors)}")
    return model_from_llama_args(text, flavors[flavor])


# config.json key -> decoder_spec argument; num_key_value_heads and tie_word_embeddings
# take Hugging Face's defaults (num_attention_heads, false) when absent.
_HF_KEYS = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "vocab_size": "vocab_size", "intermediate_size": "ffn_dim",
}
_HF_ARCHITECTURE = "LlamaForCausalLM"


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """A Hugging Face ``LlamaForCausalLM`` config.json, read without transformers.

    Other architectures, biases and a head_dim other than hidden_size / heads change the
    parameter shapes this model describes, so they are refused, naming the key.
    """
    path = Path(path)
    config = read_json(path, "model config")
    if not isinstance(config, dict):
        raise PlannerError(f"model config '{path}' is not a JSON object")
    if config.get("architectures") != [_HF_ARCHITECTURE]:
        raise PlannerError(f"{path}: 'architectures' is {config.get('architectures')!r}; the planner reads {_HF_ARCHITECTURE} configs")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise PlannerError(f"{path}: '{key}' is true; the planner's shapes have no biases")
    numbers = {}
    for key, arg in [*_HF_KEYS.items(), ("num_key_value_heads", "n_kv_heads")]:
        value = config.get(key)
        if value is None and key in _HF_KEYS:
            raise PlannerError(f"{path}: missing key '{key}'")
        if value is not None:
            _check_positive(str(path), f"'{key}'", value)
        numbers[arg] = value
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * numbers["n_heads"] != numbers["dim"]:
        raise PlannerError(f"{path}: 'head_dim' {head_dim} is not hidden_size / num_attention_heads")
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise PlannerError(f"{path}: 'tie_word_embeddings' must be true or false, got {tied!r}")
    name = path.resolve().parent.name if path.name == "config.json" else path.stem
    return decoder_spec(name, tied_embeddings=tied, **numbers)


def model_from_text(text: str) -> ModelSpec:
    """What ``--model`` names: a config.json path, a torchtitan ``model:flavor``, or a preset."""
    if text.endswith(".json") or Path(text).is_file():
        return model_from_hf_config(text)
    if ":" in text:
        return model_from_torchtitan(text)
    return model_preset(text)


def model_from_module(
    module,
    *,
    name: str | None = None,
    n_layers: int | None = None,
    dim: int | None = None,
    n_heads: int | None = None,
    vocab_size: int | None = None,
    ffn_dim: int | None = None,
    n_kv_heads: int | None = None,
) -> ModelSpec:
    """Read an ``nn.Module``'s parameter shapes, grouped into the runtime's units.

    Architecture numbers the shapes cannot tell (heads, ...) are read from a
    torchtitan-style ``model_args`` attribute when present, else must be given.
    """
    unit_modules = default_units(module)
    claimed: set[int] = set()
    units: list[tuple[Shape, ...]] = []
    for m in [*unit_modules, module]:
        shapes = tuple(tuple(p.shape) for p in m.parameters() if p.requires_grad and id(p) not in claimed)
        claimed.update(id(p) for p in m.parameters())
        if shapes:
            units.append(shapes)
    args = getattr(module, "model_args", None)
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    lists = [c for c in module.children() if isinstance(c, (nn.ModuleList, nn.ModuleDict))]

    def pick(given, attr, guess):
        if given is not None:
            return given
        if args is not None and getattr(args, attr, None) is not None:
            return getattr(args, attr)
        return guess

    dim = pick(dim, "dim", embeddings[0].embedding_dim if embeddings else None)
    vocab_size = pick(vocab_size, "vocab_size", embeddings[0].num_embeddings if embeddings else None)
    n_layers = pick(n_layers, "n_layers", max((len(c) for c in lists), default=None))
    n_heads = pick(n_heads, "n_heads", None)
    n_kv_heads = pick(n_kv_heads, "n_kv_heads", None)
    missing = [k for k, v in (("dim", dim), ("n_layers", n_layers), ("n_heads", n_heads), ("vocab_size", vocab_size)) if v is None]
    if missing:
        raise PlannerError(f"cannot infer {', '.join(missing)} from the module; pass them to model_from_module")
    if ffn_dim is None:
        ffn_dim = 4 * dim
    embedding_params = sum(e.weight.numel() for e in embeddings)
    return ModelSpec(name or type(module).__name__, dim, n_layers, n_heads, vocab_size, ffn_dim, n_kv_heads, tuple(units), embedding_params)


def shapes_numel(shapes: Sequence[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
