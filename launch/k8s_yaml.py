"""YAML as the manifests are written: keys in the order built, multi-line strings (a config,
the dashboard) as literal blocks, no anchors or aliases, lines never folded."""

from __future__ import annotations

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                   style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)
# a str subclass (a Role or Mode: StrEnum) is written as its text
_Dumper.add_multi_representer(str, lambda dumper, value: _text(dumper, str.__str__(value)))


def to_yaml(obj) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=2**16)
