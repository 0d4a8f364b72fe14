"""Config files -> frozen dataclasses; unknown keys and bad values are errors naming the key."""
import dataclasses
import subprocess
import sys

import pytest

from moespec.config import ConfigError, build_config, load_config


def test_repo_configs_load():
    for name in ("tiny-deepseek-mtp", "tiny-deepseek-mtp-ep2", "tiny-llama-draft", "deepseek-v3", "llama-70b-draft"):
        config = load_config(f"configs/{name}.yaml")
        assert config.model.path
    default = load_config("configs/tiny-deepseek-mtp.yaml")
    assert default.model.path.endswith("checkpoints/tiny-deepseek-v3")


def test_overrides_and_frozen():
    config = build_config({"model": {"path": "m"}}, {"cache.page_size": 32, "max_num_seqs": 3,
                                                     "speculation": {"mode": "mtp", "num_speculative_tokens": 2}})
    assert (config.cache.page_size, config.scheduler.max_num_seqs) == (32, 3)
    assert (config.speculation.mode, config.speculation.num_speculative_tokens) == ("mtp", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.page_size = 8


def test_nested_overrides_set_one_key_and_keep_the_others():
    raw = {"model": {"path": "m"},
           "speculation": {"mode": "mtp", "num_speculative_tokens": 3,
                           "tree": {"top_k": 4, "depth": 3, "num_draft_tokens": 8}}}
    config = build_config(raw, {"speculation.tree.top_k": 2})
    assert config.speculation.tree == {"top_k": 2, "depth": 3, "num_draft_tokens": 8}
    assert raw["speculation"]["tree"]["top_k"] == 4  # the raw config is not changed in place
    fresh = build_config({"model": {"path": "m"}, "speculation": {"mode": "mtp", "num_speculative_tokens": 3,
                                                                  "tree": "auto"}},
                         {"speculation.tree.top_k": 2, "speculation.tree.depth": 3,
                          "speculation.tree.num_draft_tokens": 6})
    assert fresh.speculation.tree == {"top_k": 2, "depth": 3, "num_draft_tokens": 6}


@pytest.mark.parametrize("raw, overrides, message", [
    ({"model": {"path": "m"}, "speculation": {"mode": "mtp", "num_speculative_tokens": 3}},
     {"speculation.tree.top_k": 2, "speculation.tree.depth": 3, "speculation.tree.num_draft_tokens": 6,
      "speculation.tree.widht": 2}, "unknown key speculation.tree.widht; allowed: top_k, depth"),
    ({"model": {"path": "m"}}, {"cache.page_size.x": 1}, "cache.page_size is not a mapping"),
    ({"model": {"path": "m"}}, {"speculation.nope.x": 1}, "unknown key speculation.nope"),
    ({"model": {"path": "m"}, "cache": {"pagesize": 8}}, {}, "unknown key cache.pagesize; allowed: page_size"),
    ({"model": {"path": "m"}, "kache": {}}, {}, "unknown section 'kache'"),
    ({"model": {"path": "m", "dtype": "fp64"}}, {}, "model.dtype: 'fp64' is not allowed; allowed: 'float32'"),
    ({"model": {"path": "m"}}, {"cache.page_size": "big"}, "cache.page_size: expected int"),
    ({"model": {"path": "m"}}, {"cache.page_size": 0}, "cache.page_size must be >= 1"),
    ({"model": {"path": "m"}}, {"speculation": {"mode": "eagle7"}}, "speculation.mode: 'eagle7' is not allowed"),
    ({"model": {"path": "m"}}, {"speculation": {"mode": "draft"}}, "needs speculation.draft_model"),
    ({"model": {"path": "m"}}, {"pages": 3}, "unknown option 'pages'"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_margin": -0.1}, "speculation.adaptive_margin must be >= 0"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_sureness": -1}, "speculation.adaptive_sureness must be >= 0"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_keep_margin": -0.01},
     "speculation.adaptive_keep_margin must be >= 0"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_shift_sigmas": -1},
     "speculation.adaptive_shift_sigmas must be >= 0"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_explore_loss": 1.5},
     "speculation.adaptive_explore_loss must be between 0 and 1"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_explore_share": -0.01},
     "speculation.adaptive_explore_share must be between 0 and 1"),
    ({"model": {"path": "m"}}, {"speculation.adaptive_decide_every": 0},
     "speculation.adaptive_decide_every must be an integer >= 1"),
    ({}, {}, "model.path is required"),
    ({"model": {"path": "m", "attention_backend": "flashinfer"}}, {"parallel.two_batch_overlap": True},
     "parallel.two_batch_overlap needs model.attention_backend: torch"),
])
def test_bad_config_names_the_key(raw, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        build_config(raw, overrides)


def test_cli_generate_json(tmp_path):
    from tiny_models import save_tiny_llama
    save_tiny_llama(tmp_path / "m")
    (tmp_path / "c.yaml").write_text(f"model:\n  path: {tmp_path / 'm'}\ncache:\n  page_size: 4\n  num_kv_pages: 64\n")
    # the model has no tokenizer: a text prompt is a clear error, exit code != 0
    result = subprocess.run([sys.executable, "-m", "moespec", "generate", "--config", str(tmp_path / "c.yaml"),
                             "--prompt", "hi", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no tokenizer" in result.stderr
    result = subprocess.run([sys.executable, "-m", "moespec", "generate", "--config", str(tmp_path / "c.yaml"),
                             "--set", "cache.page_size=zz", "--prompt", "hi"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "cache.page_size: expected int" in result.stderr
