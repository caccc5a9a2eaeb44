"""Write autosearch/core/hf_config_keys.yaml: the keys, and their defaults, that transformers'
config classes declare for each Hugging Face family `autosearch.core.hf_config` reads.

    python tools/hf_config_keys.py [--check]

A published config.json often gives only what differs from its family's defaults in
transformers, and the reader warns on a key its family does not know (a typo such as
``num_key_value_head``). Both need what transformers' config classes declare, and importing
them imports torch, which the cost model's side of autosearch never does: so they are read here,
once, and shipped as data. For each family: ``defaults``, the fields of its config class with
their default values; ``aliases``, its ``attribute_map`` (another name -> the field); and
``derived``, the keys a config object writes that it sets from others in ``__post_init__``; under
``common``, the fields of ``PreTrainedConfig`` and the generation parameters it still accepts
in a config.json (``GenerationConfig``). ``--check`` exits 1 when the file differs from what the
installed transformers gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autosearch.core.hf_config import NESTED, SUPPORTED  # noqa: E402

OUT = ROOT / "autosearch" / "core" / "hf_config_keys.yaml"
HEADER = """\
# What transformers' config class of each Hugging Face family that autosearch reads declares
# (autosearch/core/hf_config.py): `defaults`, its fields and their default values; `aliases`, its
# attribute_map (another name -> the field); `derived`, the keys it writes that it sets from
# others; and under `common`, the keys of PreTrainedConfig and the generation parameters a
# config.json may still carry.
# Written by `python tools/hf_config_keys.py` from transformers {version}; do not edit by hand.
"""


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def declared(config_class, common: set[str]) -> dict:
    """The defaults of a transformers config class's fields (a dataclass from transformers 5)
    that are not `common`, each under the name it is stored and written under (its
    ``attribute_map`` entry, where a field has one: DeepseekV3Config's num_mtp_layers is written
    num_nextn_predict_layers), its aliases, and the keys it derives from others."""
    aliases = config_class.attribute_map
    defaults = {
        aliases.get(f.name, f.name): _default(f)
        for f in dataclasses.fields(config_class)
        if f.name not in common
    }
    # what a config object writes besides its fields (DeepSeek's qk_head_dim, set from others)
    written = set(config_class().to_dict()) - set(defaults) - set(aliases) - common
    return {
        "aliases": dict(sorted(aliases.items())),
        "defaults": dict(sorted(defaults.items())),
        "derived": sorted(k for k in written if not k.startswith("_")),
    }


def table() -> tuple[str, dict]:
    import transformers
    from transformers import CONFIG_MAPPING, GenerationConfig, PreTrainedConfig

    # what PreTrainedConfig declares and writes itself, and the generation parameters
    common = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    common |= {key for key in PreTrainedConfig().to_dict() if not key.startswith("_")}
    common |= set(GenerationConfig._get_default_generation_params())
    families = {
        model_type: declared(CONFIG_MAPPING[model_type], common)
        for model_type in sorted(SUPPORTED + tuple(NESTED))
    }
    return transformers.__version__, {"common": sorted(common), "families": families}


def render(version: str, data: dict) -> str:
    body = yaml.safe_dump(
        {"transformers": version, **data}, default_flow_style=None, width=99, sort_keys=False
    )
    return HEADER.format(version=version) + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = render(*table())
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT.relative_to(ROOT)}: {'up to date' if same else 'differs'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
