"""relpos.registry: one record per encoding, read by the plots, the explore page, the CLI and the experiment."""

import pathlib

import pytest
import torch

import relpos
from relpos import registry
from relpos.tools import explore, plots
from relpos.tools.cli import build_parser
from relpos.core.bias import AdditiveBias
from relpos.experiment import cli as experiment_cli
from relpos.experiment.model import DEFAULT_ENCODINGS, ENCODINGS, LMConfig, TransformerLM
from relpos.experiment.variants import ALL_MODELS, MODELS, describe
from relpos.layers.mha import KVCache

MODULE_TYPES = {
    "additive bias": (AdditiveBias,),
    "rotary": (relpos.RotaryEmbedding, relpos.XPos),
    "qk-vectors": (relpos.ShawRelativePosition, relpos.CoPE),
    "gate": (relpos.ForgettingGate,),
    "absolute": (relpos.LearnedAbsolutePositionEmbedding, relpos.SinusoidalPositionEmbedding),
}


@pytest.mark.parametrize("name", list(registry.ENCODINGS))
def test_every_record_builds_a_module_of_its_kind(name):
    encoding = registry.get(name)
    module = encoding.create(4, 8)
    if encoding.kind == "none":
        assert module is None
    else:
        assert isinstance(module, MODULE_TYPES[encoding.kind]), type(module)
    assert encoding.label and encoding.paper and encoding.paths
    assert encoding.plot == (name in plots.BIAS_KINDS)


def test_the_new_encodings_are_registered_but_not_in_the_default_run():
    new = ("kerple", "kerple_power", "sandwich", "fire", "xpos", "forgetting", "cope")
    assert set(new) <= set(ENCODINGS) and set(new) <= set(ALL_MODELS)
    assert not set(new) & set(DEFAULT_ENCODINGS) and not set(new) & set(MODELS)
    assert MODELS == ("none", "learned", "sinusoidal", "t5", "t5_md128", "clipped", "alibi", "rope", "log_decay", "shaw")
    assert {"kerple", "sandwich", "fire"} <= set(plots.BIAS_KINDS)
    assert describe("fire") == "FIRE" and describe("t5") == "T5 bias (max_distance = train length)"


def test_bad_names_and_options():
    with pytest.raises(ValueError, match="encoding must be one of none, learned"):
        registry.get("fourier")
    with pytest.raises(TypeError, match="encoding 'kerple' takes r1, r2; got unknown option"):
        registry.get("kerple").create(4, 8, max_distance=3)


@pytest.mark.parametrize("name", ENCODINGS)
def test_every_sequence_encoding_trains_and_decodes_in_the_experiments_model(name):
    """A tiny model per encoding: one training step moves every position parameter, and decoding token
    by token with KV caches gives the parallel logits."""
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(encoding=name, dim=16, layers=2, heads=2, train_len=12, vocab=32)).double()
    tokens = torch.randint(0, 32, (2, 12))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    position = [p for n, p in model.named_parameters() if ".position." in f".{n}" or n.startswith(("position.", "absolute."))]
    assert all(p.grad is not None for p in position), name
    with torch.no_grad():
        full = model(tokens)
        caches = [KVCache() for _ in model.blocks]
        steps = [model(tokens[:, :5], caches)] + [model(tokens[:, t : t + 1], caches) for t in range(5, 12)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-8), name


def test_cli_and_page_list_the_registry():
    parser = build_parser()
    args = parser.parse_args(["extrapolate", "--preset", "smoke", "--encodings", "kerple,sandwich,fire,xpos,forgetting,cope"])
    assert experiment_cli.config_from_args(args).encodings == ("kerple", "sandwich", "fire", "xpos", "forgetting", "cope")
    with pytest.raises(ValueError, match="unknown \\['fourier'\\]; choose from .*kerple"):
        experiment_cli.config_from_args(parser.parse_args(["extrapolate", "--encodings", "fourier"]))
    new = ("kerple", "kerple_power", "sandwich", "fire", "xpos", "forgetting", "cope")
    tasks = experiment_cli.task_configs_from_args(parser.parse_args(["tasks", "--encodings", ",".join(new)]))
    assert tasks and all(config.encodings == new for config in tasks)  # `relpos tasks` takes every new encoding
    page = explore._kind_options()
    assert all(f'<option value="{kind}">' in page for kind in plots.BIAS_KINDS)
    kinds = explore._api_kinds({})["kinds"]
    assert [k["name"] for k in kinds] == list(registry.ENCODINGS)


@pytest.mark.parametrize("kind", ["kerple", "kerple_power", "sandwich", "fire"])
def test_bias_api_draws_the_new_kinds(kind):
    data = explore._api_bias({"kind": [kind], "length": ["6"], "causal": ["1"]})
    torch.manual_seed(0)  # the page's default seed: FIRE's MLP at its seeded initialisation
    module = registry.get(kind).create(1, plots.PLOT_HEAD_DIM, causal=True, picture=True)
    assert torch.allclose(torch.tensor(data["matrix"]), module.materialize(6, 6)[0, 0].detach(), atol=1e-6)
    assert data["legend"] == registry.get(kind).summary and data["formula"]
    if kind.startswith("kerple"):
        assert data["details"] == {"r1": 1.0, "r2": 1.0}
        assert explore._api_bias({"kind": [kind], "length": ["6"], "r1": ["2.0"]})["options"] == {"r1": 2.0, "r2": 1.0}


def test_docs_table_is_the_registrys():
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "encodings" / "index.md").read_text()
    assert registry.markdown_table() in docs
