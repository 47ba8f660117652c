"""Shared pieces of the reliability tests: one tiny bundle per session (tests/conftest.py), a tiny HF target folder,
and a hash of every file under a folder so a test can prove that nothing outside the requested output changed."""
import hashlib
import shutil
from pathlib import Path

import pytest


def tree_hashes(root: Path, exclude: Path | None = None) -> dict[str, str]:
    """relative path -> sha256 (links by their target text, folders by their presence) of everything under root."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        if exclude is not None and (path == exclude or exclude in path.parents):
            continue
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + str(path.readlink())
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture()
def bundle(tiny_bundle_v6, tmp_path):
    """A private copy of the session's tiny bundle (vocab 6, block 3, max context 256)."""
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], dst)
    return dst


@pytest.fixture(scope="session")
def hf_target(tmp_path_factory):
    """A tiny random Llama saved as an HF folder (8-token vocabulary, 6 words in the tokenizer: the mask id is 6)."""
    from support.tiny import tiny_hf, tiny_tokenizer_folder

    folder = tmp_path_factory.mktemp("hf") / "target"
    hf = tiny_hf("llama", vocab=8, layers=2, seed=3)
    hf.save_pretrained(folder)
    tiny_tokenizer_folder(folder, 6)
    return folder
