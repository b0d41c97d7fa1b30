"""Calibration files shared like models (qcache.hub): hub repo ids read from a local Hugging Face cache laid out as
huggingface_hub lays it out, folders laid out like a hub repo with a model card, pushing (the hub API replaced by a
recorder). Nothing here touches the network: HF_HUB_OFFLINE=1 unless a test replaces the hub API."""

import hashlib
import json
import shutil

import pytest
import torch
from huggingface_hub import ModelCard, scan_cache_dir
from safetensors.torch import load_file

from calibration import calibrate
from conftest import make_model
from qcache.presets import recipe
from qcache import QuantCache, hub
from qcache.tools import publish
from qcache.calibfile import load_calibration, save_calibration

REPO = "qcache-tests/tiny-llama-2bit"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
QUALITY = "# KV cache comparison: tiny\n\n| cache | token PPL |\n|---|---:|\n| quant-2bit | 12.34 |\n"


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    model = make_model("llama")
    ids = torch.randint(2, 96, (2, 48), generator=torch.Generator().manual_seed(2))
    opts = recipe(bits=2, k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)
    data = calibrate(model, ids, opts, {"model": "tiny-llama", "data_source": "random ids", "data_sha256": "ab" * 32,
                                        "samples": 2, "seq_len": 48}, progress=False)
    return save_calibration(tmp_path_factory.mktemp("calib") / "tiny.qcache.safetensors", data)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cache_put(cache, repo_id, files, commit=COMMIT, ref="main"):
    """Store `files` {name: local path} as huggingface_hub stores a download: content-addressed blobs, a snapshot
    folder per commit whose entries link to the blobs, and refs/<ref> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for name, src in files.items():
        blob = hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, repo / "blobs" / blob)
        (repo / "snapshots" / commit / name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs" / ref).write_text(commit)


def test_fake_cache_has_the_real_layout(hf_cache, calib_file):
    cache_put(hf_cache, REPO, {hub.CALIBRATION_FILENAME: calib_file})
    (repo,) = scan_cache_dir(hf_cache).repos  # huggingface_hub's own reader of the cache
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == {"main"}
    assert {f.file_name for f in revision.files} == {hub.CALIBRATION_FILENAME}


def test_from_calibration_reads_a_hub_id_from_the_cache(hf_cache, calib_file):
    cache_put(hf_cache, REPO, {hub.CALIBRATION_FILENAME: calib_file})
    data = load_calibration(REPO)
    assert str(hf_cache) in data.path and data.path.endswith(f"{COMMIT}/{hub.CALIBRATION_FILENAME}")
    original = load_file(calib_file)
    assert load_file(data.path).keys() == original.keys()
    assert all(torch.equal(load_file(data.path)[k], original[k]) for k in original)
    cache = QuantCache.from_calibration(REPO)  # the file's options reach the cache
    assert (cache.options.k_bits, cache.options.k_group_size) == (2, 16)


def test_revision_picks_the_ref(hf_cache, calib_file, tmp_path):
    other = tmp_path / "other.safetensors"
    data = load_calibration(calib_file)
    data.settings = {**data.settings, "data_source": "the v2 tag"}
    save_calibration(other, data)
    cache_put(hf_cache, REPO, {hub.CALIBRATION_FILENAME: calib_file})
    cache_put(hf_cache, REPO, {hub.CALIBRATION_FILENAME: other}, commit="f" * 40, ref="v2")
    assert load_calibration(REPO).settings["data_source"] == "random ids"
    assert load_calibration(REPO, revision="v2").settings["data_source"] == "the v2 tag"


def test_offline_and_not_cached_raises_clearly(hf_cache):
    with pytest.raises(ValueError, match=r"'qcache-tests/absent' .* is not in the local Hugging Face cache .*"
                                         r"HF_HUB_OFFLINE=1 forbids downloading it"):
        QuantCache.from_calibration("qcache-tests/absent")


def test_offline_is_read_when_called(hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as if imported before the variable was set
    assert hub.is_offline()
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 forbids"):
        hub.resolve_calibration("qcache-tests/absent")


@pytest.mark.parametrize("source, match", [("no-such-file.safetensors", "does not exist; allowed"),
                                           ("a/b/c", "does not exist; allowed"),
                                           ("org/bad--name", "does not exist; allowed")])
def test_neither_path_nor_repo_id(hf_cache, source, match):
    with pytest.raises(ValueError, match=match):
        hub.resolve_calibration(source)


def test_save_folder_writes_file_and_model_card(calib_file, tmp_path):
    folder = publish.save_folder(calib_file, tmp_path / "repo", quality=QUALITY, repo_id=REPO)
    assert sorted(p.name for p in folder.iterdir()) == sorted([hub.CALIBRATION_FILENAME, hub.CARD_FILENAME])
    assert (folder / hub.CALIBRATION_FILENAME).read_bytes() == calib_file.read_bytes()
    card = ModelCard.load(folder / hub.CARD_FILENAME)
    assert card.data.library_name == "qcache" and "kv-cache" in card.data.tags
    text = card.text
    data = load_calibration(calib_file)
    assert "# qcache calibration for tiny-llama" in text
    assert "| model_type | `llama` |" in text and "| KV heads x head_dim | 2 x 32 |" in text
    assert "| bits (keys / values) | 2 / 2 |" in text and '"k_group_size": 16' in text
    assert f"| sha256 | `{data.settings['data_sha256']}` |" in text and "| source | random ids |" in text
    assert "## KV cache comparison: tiny" in text and "| quant-2bit | 12.34 |" in text  # demoted one level
    assert hashlib.sha256(calib_file.read_bytes()).hexdigest() in text
    assert f'QuantCache.from_calibration("{REPO}")' in text
    assert QuantCache.from_calibration(folder).options.k_bits == 2  # the folder loads as it is


def test_card_without_quality_says_so(calib_file, tmp_path):
    text = (publish.save_folder(calib_file, tmp_path / "repo") / hub.CARD_FILENAME).read_text()
    assert "Not measured for this card" in text and "base_model" not in text


def test_card_names_the_base_model_of_a_short_name(calib_file, tmp_path):
    data = load_calibration(calib_file)
    data.settings = {**data.settings, "model": "smollm2-135m"}
    card = ModelCard(publish.model_card(data, "0" * 64))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_hub_round_trip_offline(hf_cache, calib_file, tmp_path):
    """save_folder -> (the files as a download stores them) -> QuantCache.from_calibration("org/name")."""
    folder = publish.save_folder(calib_file, tmp_path / "repo", quality=QUALITY, repo_id=REPO)
    cache_put(hf_cache, REPO, {p.name: p for p in folder.iterdir()})
    data = load_calibration(REPO)
    original = load_calibration(calib_file)
    assert data.options == original.options and data.model == original.model
    assert all(torch.equal(data.layer(i)[n], original.layer(i)[n]) for i in original.layers for n in original.layer(i))
    card = hub.resolve_calibration(REPO, filename=hub.CARD_FILENAME)
    assert card.read_text() == (folder / hub.CARD_FILENAME).read_text()


def test_folder_without_the_file_lists_what_it_has(tmp_path):
    (tmp_path / "other.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no 'qcache-calibration.safetensors'; .*\['other.safetensors'\]"):
        hub.resolve_calibration(tmp_path)


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records what would be sent."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=False, exist_ok=False, **kwargs):
        RecordingApi.calls.append(("create_repo", repo_id, private, exist_ok))

    def upload_folder(self, repo_id, folder_path, commit_message=None, allow_patterns=None, **kwargs):
        files = sorted(p.name for p in folder_path.iterdir())
        RecordingApi.calls.append(("upload_folder", repo_id, files, sorted(allow_patterns)))
        return type("CommitInfo", (), {"commit_url": f"https://hub.example/{repo_id}/commit/1"})()


@pytest.fixture
def recording_hub(monkeypatch):
    from huggingface_hub import constants

    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    RecordingApi.calls = []
    return RecordingApi.calls


def test_push_uploads_the_folder(recording_hub, calib_file, tmp_path):
    folder = publish.save_folder(calib_file, tmp_path / "repo")
    url = publish.push_to_hub(folder, REPO, private=True)
    expected = sorted([hub.CALIBRATION_FILENAME, hub.CARD_FILENAME])
    assert recording_hub == [("create_repo", REPO, True, True), ("upload_folder", REPO, expected, expected)]
    assert url.endswith("/commit/1")


@pytest.mark.parametrize("case, match", [("offline", "needs the network, but HF_HUB_OFFLINE=1"),
                                         ("no-card", r"lacks \['README.md'\]"),
                                         ("bad-repo-id", "is not a hub repo id")])
def test_push_refuses(recording_hub, calib_file, tmp_path, monkeypatch, case, match):
    folder = publish.save_folder(calib_file, tmp_path / "repo")
    repo = REPO
    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif case == "no-card":
        (folder / hub.CARD_FILENAME).unlink()
    else:
        repo = "not a repo"
    with pytest.raises(ValueError, match=match):
        publish.push_to_hub(folder, repo)
    assert recording_hub == []  # nothing was sent


# ---------------------------------------------------------------------------------------------------------
# python -m qcache.calibrate --save-dir / --push-to-hub
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """calibration.cli.main on conftest's tiny llama with a word tokenizer and a small --data file."""
    from calibration import cli as cli_module

    model = make_model("llama")

    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False, return_tensors=None):
            return {"input_ids": torch.tensor([[2 + int(w[1:]) % 90 for w in text.split()]])}

    monkeypatch.setattr("qcache.tools.models.load_model", lambda name, dtype=None: (model, WordTokenizer()))
    text = tmp_path / "data.jsonl"
    text.write_text("\n".join(json.dumps({"text": " ".join(f"w{i}" for i in range(j, j + 150))}) for j in range(3)))
    quality = tmp_path / "quality.md"
    quality.write_text(QUALITY)
    common = ["--model", "tiny", "--data", str(text), "--samples", "2", "--seq-len", "64", "--bits", "3",
              "--rotation-len", "64"]
    return lambda *extra: cli_module.main(common + list(extra)), quality


def test_cli_save_dir(cli, tmp_path):
    run, quality = cli
    assert run("--save-dir", str(tmp_path / "repo"), "--quality", str(quality)) == 0
    data = load_calibration(tmp_path / "repo")
    assert data.options["k_bits"] == 3 and data.kv_ranges is not None
    assert "| quant-2bit | 12.34 |" in (tmp_path / "repo" / hub.CARD_FILENAME).read_text()


def test_cli_push_to_hub(cli, recording_hub, tmp_path):
    run, _ = cli
    assert run("--push-to-hub", REPO, "--out", str(tmp_path / "x.safetensors")) == 0
    assert load_calibration(tmp_path / "x.safetensors").options["v_bits"] == 3
    assert [c[0] for c in recording_hub] == ["create_repo", "upload_folder"]
    assert recording_hub[1][2] == sorted([hub.CALIBRATION_FILENAME, hub.CARD_FILENAME])


@pytest.mark.parametrize("extra, message", [
    ((), "give --out FILE, --save-dir DIR and/or --push-to-hub"),
    (("--out", "x.safetensors", "--quality", "q.md"), "--quality goes into the model card"),
    (("--push-to-hub", "not a repo"), "is not a hub repo id"),
])
def test_cli_rejects(cli, capsys, extra, message):
    run, _ = cli
    with pytest.raises(SystemExit):
        run(*extra)
    assert message in capsys.readouterr().err


def test_cli_push_offline_fails_before_calibrating(cli, hf_cache, capsys, monkeypatch):
    run, _ = cli
    monkeypatch.setattr("calibration.calibrate", lambda *a, **k: pytest.fail("calibrated although offline"))
    with pytest.raises(SystemExit):
        run("--push-to-hub", REPO)
    assert "needs the network, but HF_HUB_OFFLINE=1" in capsys.readouterr().err


def test_cli_too_short_text_names_the_measurement_flags(cli, tmp_path):
    run, _ = cli
    with pytest.raises(ValueError, match=r"450 tokens.*--rotation-samples/--rotation-len"):
        run("--rotation-len", "4096", "--out", str(tmp_path / "x.safetensors"))
