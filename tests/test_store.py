"""The profile store: lookup by (model, device), closest match, clear misses, staleness."""

import dataclasses
import json

import pytest
import torch
from loguru import logger

import autofit
from autofit.device.probe import cpu_device
from autofit.base.errors import ProfileError
from autofit.config.train_config import TrainConfig
from autofit.config.spec import load_spec, parse_spec
from autofit.profiles.store import ProfileStore
from conftest import REPO, run_cli, tiny_gpt_dict, write_spec
from test_profile import make_profile

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85520809984, "compute_capability": "9.0",
        "driver": "580.95.05", "fingerprint": "nvidia-h100-80gb-hbm3-80gib-nomig-drv580-torch2.13",
        "slug": "nvidia-h100-80gb-hbm3"}


@pytest.fixture
def warnings():
    """loguru warnings, as plain strings."""
    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")
    yield messages
    logger.remove(sink)


@pytest.fixture
def spec():
    return parse_spec(tiny_gpt_dict(), source_dir=REPO)


@pytest.fixture
def store(tmp_path, spec):
    """This CPU's profile of `tiny`, an H100 one, and another model's."""
    store = ProfileStore(tmp_path / "profiles")
    store.save(make_profile(spec, TrainConfig(micro_batch_size=8)))
    store.save(make_profile(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=8), **H100))
    other = parse_spec(tiny_gpt_dict(name="other"), source_dir=REPO)
    store.save(make_profile(other, TrainConfig(micro_batch_size=4, grad_accum_steps=2)))
    return store


def test_lookup_picks_this_devices_profile(store, warnings):
    names = [path.name for path, _ in store.list()]
    assert names == ["other--cpu.yaml", "tiny--cpu.yaml", "tiny--nvidia-h100-80gb-hbm3.yaml"]
    profile = autofit.load_profile("tiny", store=store, device="cpu")
    assert profile.device.fingerprint == cpu_device().fingerprint and profile.config.precision == "32-true"
    assert warnings == []
    # The probe is NVML-only: loading a profile leaves CUDA uninitialised in this process.
    assert not torch.cuda.is_initialized()
    # On the H100 (as its probe would describe it) the H100 profile is chosen.
    h100 = dataclasses.replace(cpu_device(), kind="cuda", index=0, name=H100["name"],
                               memory_total_bytes=H100["memory_bytes"], compute_capability=(9, 0),
                               driver_version=H100["driver"], fingerprint=H100["fingerprint"], slug=H100["slug"])
    assert autofit.load_profile("tiny", store=store.root, device=h100).config.precision == "bf16-mixed"
    assert store.find("tiny", H100["fingerprint"])[0][1].device.name == H100["name"]


def test_store_root_defaults_to_env_then_profiles(monkeypatch, tmp_path, spec):
    monkeypatch.delenv("AUTOFIT_STORE", raising=False)
    assert ProfileStore().root == autofit.profiles.store.Path("profiles")
    monkeypatch.setenv("AUTOFIT_STORE", str(tmp_path / "elsewhere"))
    path = ProfileStore().save(make_profile(spec, TrainConfig(micro_batch_size=8)))
    assert path == tmp_path / "elsewhere" / "tiny--cpu.yaml"
    assert autofit.load_profile("tiny", device="cpu").model.name == "tiny"


def test_closest_profile_for_the_same_gpu_warns_what_differs(tmp_path, spec, warnings):
    store = ProfileStore(tmp_path)
    here = cpu_device()
    # Tuned on this kind of CPU, but with fewer GiB and an older torch: another fingerprint.
    store.save(make_profile(spec, TrainConfig(micro_batch_size=8), torch="2.11.0", memory_bytes=2**33,
                            fingerprint="cpu-older"))
    profile = autofit.load_profile("tiny", store=store, device="cpu")
    assert profile.device.fingerprint == "cpu-older"
    closest = [w for w in warnings if "using the closest" in w]
    assert len(closest) == 1
    assert "torch: profile '2.11.0'" in closest[0] and "memory_bytes" in closest[0]
    assert here.fingerprint in closest[0]


def test_missing_profile_lists_what_the_store_has(store, tmp_path):
    with pytest.raises(ProfileError) as err:
        autofit.load_profile("gpt-huge", store=store, device="cpu")
    message = str(err.value)
    assert "'gpt-huge'" in message and "\n" not in message
    for listed in ("tiny--cpu.yaml", "tiny--nvidia-h100-80gb-hbm3.yaml", "other--cpu.yaml", "autofit tune"):
        assert listed in message
    # A model whose only profile is for another GPU is a miss too, naming that profile.
    (store.root / "tiny--cpu.yaml").unlink()
    with pytest.raises(ProfileError, match="tiny on NVIDIA H100"):
        autofit.load_profile("tiny", store=store, device="cpu")

    result = run_cli("profiles", "show", "gpt-huge", "--store", store.root, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "other--cpu.yaml" in result.stderr
    assert f"autofit tune MODEL.yaml --out {store.root}" in result.stderr

    empty = ProfileStore(tmp_path / "empty")
    with pytest.raises(ProfileError, match="has no profiles"):
        autofit.load_profile("tiny", store=empty, device="cpu")


def test_unreadable_files_are_skipped_with_a_warning(store, warnings):
    (store.root / "broken.yaml").write_text("schema: 1\nmodel: [\n")
    (store.root / ".tiny--cpu.yaml.123.tmp").write_text("half a file")
    assert len(store.list()) == 3
    assert any("broken.yaml" in w for w in warnings)


def test_stale_profiles_are_reported(tmp_path, warnings):
    spec_path = write_spec(tmp_path, tiny_gpt_dict())
    spec = load_spec(spec_path)
    store = ProfileStore(tmp_path / "profiles")
    profile = make_profile(spec, TrainConfig(micro_batch_size=8))
    store.save(profile)
    assert store.stale_reasons(profile, spec) == []

    write_spec(tmp_path, tiny_gpt_dict(optimizer={"lr": 5e-4}))  # the model.yaml changes after tuning
    edited = load_spec(spec_path)
    assert any("spec hash changed" in r for r in store.stale_reasons(profile, edited))
    rows = json.loads(run_cli("profiles", "list", "--store", store.root, "--spec", spec_path, "--json",
                              cwd=tmp_path).stdout)["profiles"]
    assert rows[0]["file"] == "tiny--cpu.yaml" and any("spec hash" in r for r in rows[0]["stale"])
    table = run_cli("profiles", "list", "--store", store.root, "--spec", spec_path, cwd=tmp_path).stdout
    assert "spec hash changed" in table and "32-true" in table and "8x1" in table

    old_torch = dataclasses.replace(profile, device=dataclasses.replace(profile.device, torch="2.9.1+cu128"))
    assert any("torch changed" in r for r in store.stale_reasons(old_torch))
    patch_only = dataclasses.replace(profile, device=dataclasses.replace(
        profile.device, torch=torch.__version__.split("+")[0].rsplit(".", 1)[0] + ".99"))
    assert store.stale_reasons(patch_only) == []

    gpu = dataclasses.replace(profile, device=dataclasses.replace(profile.device, name=H100["name"], driver="570.1"))
    here = dataclasses.replace(cpu_device(), kind="cuda", name=H100["name"], driver_version="580.95.05")
    assert any("driver major changed" in r for r in store.stale_reasons(gpu, devices=[here]))
    assert store.stale_reasons(gpu, devices=[cpu_device()]) == []  # no such GPU here: cannot judge its driver

    store.save(old_torch)
    autofit.load_profile("tiny", store=store, device="cpu")
    assert any("stale" in w and "torch changed" in w for w in warnings)


def test_loading_a_file_tuned_elsewhere_warns(tmp_path, spec, warnings):
    path = make_profile(spec, TrainConfig(micro_batch_size=8), **H100).save(tmp_path / "h100.yaml")
    assert autofit.load_profile(path, device="cpu").device.name == H100["name"]
    assert any("tuned on another device" in w and "name: profile 'NVIDIA H100" in w for w in warnings)
    # A file name inside the store works as well as a path.
    store = ProfileStore(tmp_path)
    assert autofit.load_profile("h100", store=store, device="cpu") == autofit.load_profile(path, device="cpu")
