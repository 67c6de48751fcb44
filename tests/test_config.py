"""Config resolution: precedence, coercion, clear errors, documented fields."""

from pathlib import Path

import pytest

from node.cli import _parser, join_config
from node.config import field_docs, parse_hostport, resolve_config


def test_defaults() -> None:
    c = resolve_config()
    assert c.node.stage == "auto" and c.swarm.model == "tiny" and c.model.d_model == 128


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[train]\nlr = 0.1\nwarmup_steps = 5\n[net]\nbootstrap = ["a:1", "b:2"]\n')
    c = resolve_config(
        f, {"MURMUR_TRAIN_LR": "0.2", "MURMUR_TRAIN_MAX_QUEUE": "7"}, {"train.max_queue": "9"}
    )
    assert c.train.lr == 0.2  # env beats file
    assert c.train.warmup_steps == 5  # file beats default
    assert c.train.max_queue == 9  # flags beat env
    assert c.net.bootstrap == ("a:1", "b:2")


def test_model_preset_then_overrides(tmp_path: Path) -> None:
    c = resolve_config(
        None, {}, {"swarm.model": "small", "model.num_blocks": "4", "swarm.num_block_stages": "2"}
    )
    assert c.model.d_model == 256 and c.model.num_blocks == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.lrr": "1"}, "did you mean 'lr'"),
        ({"trian.lr": "1"}, "did you mean 'train'"),
        ({"train.lr": "fast"}, "cannot use 'fast'"),
        ({"node.stage": "9"}, "--stage must be"),
        ({"swarm.num_block_stages": "4"}, "cannot be split"),
        ({"net.listen": "nope"}, "HOST:PORT"),
        ({"swarm.model": "huge"}, "huge"),
        ({"train.wire_codec": "zip"}, "wire_codec"),
        ({"train.route_cutoff": "0.5"}, "route_cutoff must be 0"),
        ({"sync.max_step_scale": "0.5"}, "max_step_scale must be at least 1"),
        ({"train.predict_steps": "-1"}, "predict_steps must be >= 0"),
        ({"train.predict_steps": "nan"}, "predict_steps must be >= 0"),
    ],
)
def test_clear_errors(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_config(None, {}, overrides)


def test_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        resolve_config(bad)


def test_cli_flags_map_to_settings() -> None:
    args = _parser().parse_args(
        [
            "join",
            "--stage",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--bootstrap",
            "h:1,h:2",
            "--swarm",
            "x",
            "--no-zeroconf",
            "--recovery",
            "random",
            "--set",
            "train.lr=0.5",
        ]
    )
    c = join_config(args)
    assert (c.node.stage, c.net.listen, c.net.bootstrap, c.swarm.name) == (
        "2",
        "127.0.0.1:0",
        ("h:1", "h:2"),
        "x",
    )
    assert c.net.zeroconf is False and c.train.lr == 0.5 and c.recovery.method == "random"


def test_every_field_is_documented() -> None:
    missing = [key for key, _, doc in field_docs() if not doc and not key.startswith("model.")]
    assert missing == []


def test_parse_hostport() -> None:
    assert parse_hostport("1.2.3.4:5") == ("1.2.3.4", 5)
    assert parse_hostport(":80") == ("0.0.0.0", 80)
    with pytest.raises(ValueError):
        parse_hostport("1.2.3.4:99999")
