"""The embedded model cache: complete caches are reused, partial or corrupted ones rebuilt, and a
failed conversion leaves nothing behind. The GGUF conversion itself is replaced by a stub writer
(the real one runs in test_gemma.py)."""

import pytest

from treespec.models import loading


@pytest.fixture
def stub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = []

    def fake_convert(out_dir, progress):
        calls.append(out_dir)
        (out_dir / "model.safetensors").write_bytes(b"weights" * 100)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "tokenizer.json").write_text('{"model": {}}')
        (out_dir / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(loading, "_convert_embedded_gemma", fake_convert)
    return tmp_path, calls


def test_complete_cache_is_reused(stub_cache):
    root, calls = stub_cache
    first = loading.embedded_gemma_dir(progress=False)
    assert loading.cache_is_valid(first) and len(calls) == 1
    assert loading.embedded_gemma_dir(progress=False) == first and len(calls) == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_partial_or_corrupted_cache_is_rebuilt(stub_cache, damage):
    root, calls = stub_cache
    cache = loading.embedded_gemma_dir(progress=False)
    weights = cache / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:10])
    elif damage == "flip":
        weights.write_bytes(b"X" + weights.read_bytes()[1:])  # same size, different content
    elif damage == "manifest":
        (cache / "treespec-manifest.json").unlink()
    else:
        weights.unlink()
    assert not loading.cache_is_valid(cache)
    assert loading.embedded_gemma_dir(progress=False) == cache
    assert len(calls) == 2 and loading.cache_is_valid(cache)
    assert weights.read_bytes() == b"weights" * 100


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))

    def broken_convert(out_dir, progress):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("conversion interrupted")

    monkeypatch.setattr(loading, "_convert_embedded_gemma", broken_convert)
    with pytest.raises(RuntimeError, match="conversion interrupted"):
        loading.embedded_gemma_dir(progress=False)
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def _rewrite_manifest(cache, edit):
    import json

    path = cache / "treespec-manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("drop", ["model.safetensors", "config.json", "tokenizer.json", "format"])
def test_manifest_missing_a_required_entry_is_rebuilt(stub_cache, drop):
    root, calls = stub_cache
    cache = loading.embedded_gemma_dir(progress=False)
    if drop == "format":
        _rewrite_manifest(cache, lambda m: m.pop("format"))
    else:
        _rewrite_manifest(cache, lambda m: m["files"].pop(drop))
        if drop == "model.safetensors":  # the manifest lists only the small files, weights are junk
            (cache / "model.safetensors").write_bytes(b"junk")
    assert not loading.cache_is_valid(cache)
    assert loading.embedded_gemma_dir(progress=False) == cache
    assert len(calls) == 2 and loading.cache_is_valid(cache)
    assert (cache / "model.safetensors").read_bytes() == b"weights" * 100
