"""Test support: a training-operator resource checked against the schema its Python SDK publishes.

kubernetes-validate has schemas for Kubernetes' own kinds only. The training
operator's SDK (``kubeflow-training``) carries the PyTorchJob schema as
generated models: each has ``openapi_types`` (field -> type) and
``attribute_map`` (field -> JSON name). :func:`problems` walks a manifest
through them, refusing unknown fields and wrong scalar types, and hands every
pod template to kubernetes-validate as a ``PodTemplate``.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
from kubeflow.training import models

_SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "object": (object,)}
_DICT = re.compile(r"dict\(str, (.+)\)")
_LIST = re.compile(r"list\[(.+)\]")


def problems(value: Any, type_name: str, where: str = "") -> list[str]:
    """Every way ``value`` breaks schema type ``type_name`` (empty: it conforms)."""
    if type_name in _SCALARS:
        ok = isinstance(value, _SCALARS[type_name]) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: {value!r} is not {type_name}"]
    if match := _DICT.fullmatch(type_name):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        return [p for key, item in value.items() for p in problems(item, match[1], f"{where}.{key}")]
    if match := _LIST.fullmatch(type_name):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [p for i, item in enumerate(value) for p in problems(item, match[1], f"{where}[{i}]")]
    if type_name == "V1PodTemplateSpec":
        return _pod_template(value, where)
    if type_name == "V1ObjectMeta":
        return [] if isinstance(value, dict) else [f"{where}: expected object metadata"]
    model = getattr(models, type_name)
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping"]
    fields = {json: attr for attr, json in model.attribute_map.items()}
    out = [f"{where}.{key}: not a field of {type_name}" for key in value if key not in fields]
    for key, item in value.items():
        if key in fields:
            out += problems(item, model.openapi_types[fields[key]], f"{where}.{key}")
    return out


def _pod_template(value: Any, where: str) -> list[str]:
    resource = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": value}
    try:
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}"]
    return []
