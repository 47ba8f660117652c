"""DeepSpec draft checkpoints: config.json + model.safetensors (reference §4). Safetensors only, strict checks."""
from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dspark.errors import DSparkError
from dspark.files import atomic_folder, normal_mode, read_json
from dspark.models.config import WEIGHTS, WEIGHTS_INDEX, DraftConfig, TargetConfig
from dspark.models.drafter import DSparkDrafter
from dspark.models.layouts import Layout, detect, vocab_map
from dspark.models.tensors import CheckpointTensors, LazyWeights, params_on_meta, read_shard_index
from dspark.resolve import resolve_draft

SHARED = ("embed_tokens.weight", "lm_head.weight")


def read_layout(folder: Path, num_target_layers: int | None = None) -> Layout:
    """The draft's config.json in whichever layout it comes (dspark.models.layouts), as DeepSpec's fields."""
    path = folder / "config.json"
    if not path.exists():
        raise DSparkError(f"draft folder {folder} has no config.json (expected a DeepSpec checkpoint)")
    raw = read_json(path, f"draft config {path}")
    if not isinstance(raw, dict):
        raise DSparkError(f"draft config {path} is not a JSON object")
    return detect(raw, f"draft config {path}", num_target_layers)


def read_draft_config(folder: Path, num_target_layers: int | None = None) -> DraftConfig:
    return read_layout(folder, num_target_layers).config


def _check_present(path: Path) -> None:
    if not path.exists() and not (path.parent / WEIGHTS_INDEX).exists():
        pickles = [p.name for p in path.parent.glob("*.bin")] + [p.name for p in path.parent.glob("*.pt")]
        hint = f" ({', '.join(pickles)} are pickles and are never loaded)" if pickles else ""
        raise DSparkError(f"draft folder {path.parent} has no {WEIGHTS}{hint}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards model-0000i-of-0000n.safetensors its index lists (checked first)."""
    _check_present(path)
    if not path.exists():
        return _read_shards(path.parent, path.parent / WEIGHTS_INDEX)
    return _read_file(path)


def _read_file(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if names is not None and names - keys:
                raise DSparkError(f"draft shard {path.name} lacks {sorted(names - keys)[0]}, which "
                                  f"{WEIGHTS_INDEX} places there")
            return {k: f.get_tensor(k) for k in (keys if names is None else names)}
    except (SafetensorError, OSError, ValueError) as e:
        raise DSparkError(f"draft weights {path} are corrupt or not safetensors ({str(e).splitlines()[0]})") from None


def _read_shards(folder: Path, index: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in sorted(read_shard_index(folder).items()):
        tensors.update(_read_file(folder / shard, names))
    return tensors


def check_draft_folder(name_or_path: str | Path) -> DraftConfig:
    """The checks that need no weights (config schema, shard index), so a bad draft is refused before a target
    is loaded."""
    folder = resolve_draft(str(name_or_path))
    cfg = read_draft_config(folder)
    if not (folder / WEIGHTS).exists() and (folder / WEIGHTS_INDEX).exists():
        read_shard_index(folder)
    return cfg


def _check_state(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], cfg: DraftConfig,
                 shared: tuple[str, ...] = SHARED) -> None:
    fc = found.get("fc.weight")
    want_fc = tuple(expected["fc.weight"].shape)
    if fc is not None and tuple(fc.shape) != want_fc:
        raise DSparkError(f"draft fc.weight is {list(fc.shape)} but {cfg.num_taps} target_layer_ids x hidden "
                          f"{cfg.hidden_size} need {list(want_fc)}")
    missing = [k for k in expected if k not in found and k not in shared]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DSparkError(f"draft checkpoint is missing {', '.join(missing[:3])}{more}")
    unexpected = [k for k in found if k not in expected]
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise DSparkError(f"draft checkpoint has unexpected keys {', '.join(unexpected[:3])}{more} "
                          f"(does config.json match the weights?)")
    for k, t in found.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise DSparkError(f"draft {k} has shape {list(t.shape)}, config.json implies {list(expected[k].shape)}")


def load_draft(name_or_path: str | Path, target: TargetConfig | None = None,
               embed_tokens: torch.nn.Embedding | None = None, lm_head: torch.nn.Linear | None = None,
               dtype: torch.dtype = torch.float32, lazy: LazyWeights | None = None) -> DSparkDrafter:
    """Load a DeepSpec draft. With a target, the draft must fit it and shares its embedding and LM head;
    without one, the checkpoint must carry embed_tokens/lm_head itself. With `lazy`, the drafter's own weights
    stay in the checkpoint (meta-device parameters registered in `lazy`), as a lazily loaded target's do."""
    folder = resolve_draft(str(name_or_path))
    layout = read_layout(folder, target.num_layers if target is not None else None)
    cfg = layout.config
    if target is not None:
        cfg.check_fits(target)
    with torch.device("meta"):
        shape_model = DSparkDrafter(cfg)
    # a reduced draft vocabulary's LM head is the drafter's own: only the embedding comes from the target
    shared = SHARED if not cfg.draft_vocab_size else SHARED[:1]
    sharing = embed_tokens is not None and (lm_head is not None or cfg.draft_vocab_size > 0)
    if lazy is None:
        stored = _read_tensors(folder / WEIGHTS)
        read = stored.__getitem__
    else:
        _check_present(folder / WEIGHTS)
        tensors = CheckpointTensors(folder, "draft")
        stored, read = {k: torch.empty(shape, device="meta") for k, shape in tensors.shapes.items()}, tensors.read
    names = _local_names(layout, stored)
    found = {names[k]: stored[k] for k in names}
    _check_state(shape_model.state_dict(), found, cfg, shared)
    ids = vocab_map(layout, set(stored), read)
    if not sharing:
        absent = [k for k in shared if k not in found]
        if absent:
            raise DSparkError(f"draft checkpoint stores no {', '.join(absent)}: load it together with its target")
    own = {k: local for k, local in names.items() if not (local in shared and sharing)}
    head = None if cfg.draft_vocab_size else lm_head
    if lazy is not None:
        with params_on_meta():
            drafter = DSparkDrafter(cfg, embed_tokens=embed_tokens, lm_head=head)
        params = dict(drafter.named_parameters(remove_duplicate=False))
        buffers = dict(drafter.named_buffers())  # (Gemma-4's layer scalars: one number each, read now)
        with torch.no_grad():
            for k, local in own.items():
                if local in buffers:
                    buffers[local].copy_(read(k).reshape(buffers[local].shape))
        lazy.add_checkpoint(tensors, {k: params[local] for k, local in own.items() if local not in buffers})
    else:
        drafter = DSparkDrafter(cfg, embed_tokens=embed_tokens, lm_head=head).to(dtype)
        drafter.load_state_dict({local: stored[k].to(dtype) for k, local in own.items()}, strict=False)
    if ids is not None:
        drafter.set_draft_vocab(ids)
    return drafter.eval()


def _local_names(layout: Layout, stored: dict[str, torch.Tensor]) -> dict[str, str]:
    """checkpoint name -> dspark's, for the drafter's own tensors (training-only ones and vocabulary maps left out)."""
    names: dict[str, str] = {}
    for k in sorted(stored):
        local = layout.local_name(k)
        if local is None:
            continue
        if local in names.values():
            twin = next(n for n, v in names.items() if v == local)
            raise DSparkError(f"draft checkpoint holds both {twin} and {k}, which are one weight ({local})")
        names[k] = local
    return names


def save_draft(drafter: DSparkDrafter, folder: Path | str, include_shared: bool = True,
               dtype: torch.dtype = torch.bfloat16, overwrite: bool = True,
               read: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (a temporary folder renamed into place). With the shared
    embed_tokens/lm_head (the default, in the precision dspark decodes with: see _stored) DeepSpec loads it as is;
    without them it is smaller, but DeepSpec would initialise those two randomly. Only an empty folder or an
    earlier draft checkpoint is replaced. `read` gives the values of weights still on the meta device (a lazily
    loaded pair's: LazyWeights.read), one at a time."""
    folder = Path(folder)
    if drafter.fixed_vocab:
        raise DSparkError("a drafter with its own reduced vocabulary (a d2t map) has no DeepSpec layout: dspark does "
                          "not write it")
    if not drafter.cfg.sample_from_anchor:
        print(f"warning: {folder} records sample_from_anchor=false (the anchor slot predicts nothing): dspark reads "
              f"it, DeepSpec would ignore it and draft wrongly", file=sys.stderr)
    if folder.exists() and not overwrite:
        raise DSparkError(f"{folder} exists; pass --force to overwrite")
    _check_replaceable(folder)
    if not include_shared:
        print(f"warning: {folder} leaves out embed_tokens/lm_head (they come from the target): dspark loads it, "
              f"DeepSpec cannot", file=sys.stderr)
    state = drafter.state_dict() if include_shared else drafter.trainable_state_dict()
    if read is not None:  # by the module's own tensors: LazyWeights knows them by identity
        live = {**dict(drafter.named_parameters(remove_duplicate=False)),
                **dict(drafter.named_buffers(remove_duplicate=False))}
        state = {k: read(live[k]) if v.is_meta else v for k, v in state.items()}
    tensors = {k: _stored(k, v, dtype) for k, v in state.items()}  # tied: 2 copies
    with atomic_folder(folder) as tmp:
        for name in KEEP_BESIDE_WEIGHTS:  # written beside the weights by other steps (dspark train)
            if (folder / name).is_file():
                shutil.copyfile(folder / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(drafter.cfg.to_dict(), indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        normal_mode(tmp / WEIGHTS)  # safetensors writes 0600
    return folder


KEEP_BESIDE_WEIGHTS = ("draft_vocab.json", "README.md")


def _stored(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The drafter's own weights are written in `dtype`. The shared embed_tokens/lm_head are the target's, which
    dspark decodes with as they are: written in `dtype` only where that is exact (a bf16 target's), else in their
    own precision, so a reader of the checkpoint alone (DeepSpec) multiplies by the same matrices."""
    narrowed = tensor.detach().to(dtype, copy=True).contiguous()
    if name in SHARED and not torch.equal(narrowed.to(tensor.dtype), tensor.detach()):
        return tensor.detach().clone().contiguous()
    return narrowed


def _check_replaceable(folder: Path) -> None:
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return
    try:
        ok = read_layout(folder).name == "DeepSpec" and folder.is_dir() and all(p.name in ("config.json", WEIGHTS, *KEEP_BESIDE_WEIGHTS) for p in folder.iterdir())
    except DSparkError:
        ok = False
    if not ok:
        raise DSparkError(f"{folder} exists and is not a dspark draft checkpoint (config.json, {WEIGHTS}); "
                          f"refusing to replace it")

