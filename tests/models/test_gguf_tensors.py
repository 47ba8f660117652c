"""A GGUF target read one tensor at a time: the same values as transformers' whole-file GGUF loader, bit for bit
(SmolLM2's Llama q/k rows come back in HF order), and no dequantized copy of the model on disk."""
import pytest
import torch

from dspark.models.gguf_tensors import GgufTensors
from dspark.models.target import load_target
from dspark.resolve import resolve_target

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2_lazy(tmp_path_factory):
    import os

    old = os.environ.get("DSPARK_CACHE")
    os.environ["DSPARK_CACHE"] = str(tmp_path_factory.mktemp("cache"))  # a cache of its own: converted here
    try:
        yield load_target("smollm2-135m", lazy=True)
    finally:
        os.environ.pop("DSPARK_CACHE") if old is None else os.environ.__setitem__("DSPARK_CACHE", old)


def test_every_tensor_equals_transformers_gguf_loader(smollm2_lazy):
    from transformers import AutoModelForCausalLM

    gguf = resolve_target("smollm2-135m")
    want = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    lazy = smollm2_lazy.lazy
    assert len(lazy.kept) == 272
    permuted = 0
    for t in lazy.kept:
        name = lazy.identity(t)[2]
        got = lazy.read(t)
        assert got.dtype == torch.float32 and torch.equal(got, want[name]), name
        permuted += ".q_proj." in name
    assert permuted == 30  # every layer's q rows, which llama.cpp's converter permuted, compared too


def test_the_cache_holds_no_weights(smollm2_lazy):
    files = sorted(p.name for p in smollm2_lazy.folder.iterdir())
    assert "model.safetensors" not in files and "config.json" in files and "tokenizer.json" in files
    assert sum(p.stat().st_size for p in smollm2_lazy.folder.iterdir()) < 8 << 20


def test_a_tensor_whose_shape_disagrees_is_refused(smollm2_lazy, monkeypatch):
    from dspark.errors import DSparkError
    from dspark.models import target as target_module

    real = GgufTensors.__init__

    def shrunk(self, path, hf):
        real(self, path, hf)
        self.shapes["model.norm.weight"] = (7,)

    monkeypatch.setattr(GgufTensors, "__init__", shrunk)
    with pytest.raises(DSparkError, match="model.norm.weight is \\[7\\]"):
        target_module.load_target("smollm2-135m", lazy=True)
