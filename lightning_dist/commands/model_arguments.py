"""The model a ``plan`` tool reads: its command-line options, and every way they can be wrong, as one-line errors.

``--model`` (a class path), ``--init-args`` (a JSON object) and ``--config`` (a LightningCLI YAML) are read here for
the three planners; a missing module, a class that is not there, JSON that is not an object, a missing or broken
YAML, or a constructor that refuses the arguments is a :class:`CommandError` (one line, exit status 2), not a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

import torch

from lightning_dist.commands.errors import CommandError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--model`` and ``--init-args``: the model a ``plan`` tool reads."""
    parser.add_argument("--config", help="a lightning-dist/LightningCLI YAML: model and strategy options from it")
    parser.add_argument("--model", help="class path of the model (LightningModule or nn.Module)")
    parser.add_argument("--init-args", default="{}", help="JSON object of the model's constructor arguments")


def load_class(class_path: str, option: str = "--model") -> Any:
    """The class (or factory) a class path names; the current directory is importable, as with ``python -m``."""
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise CommandError(f"{option} must be a class path such as examples.gpt.GPT, got {class_path!r}.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CommandError(
            f"{option} {class_path}: cannot import {module_name!r} ({err}). Run from the folder that holds it, or"
            " install its package."
        ) from None
    if not hasattr(module, name):
        raise CommandError(f"{option} {class_path}: module {module_name!r} has no {name!r}.")
    return getattr(module, name)


def json_object(text: str, option: str = "--init-args") -> dict[str, Any]:
    """``text`` parsed as a JSON object (``{"n_layer": 2}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise CommandError(f"{option} is not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise CommandError(f"{option} must be a JSON object such as '{{\"n_layer\": 2}}', got {text!r}.")
    return value


def json_value(text: str, option: str) -> Any:
    """``text`` parsed as any JSON value."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CommandError(f"{option} is not valid JSON ({err}): {text!r}") from None


def read_config(path: str) -> dict[str, Any]:
    """A LightningCLI YAML as a dict."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise CommandError(f"--config {path}: no such file.") from None
    except (OSError, yaml.YAMLError) as err:
        raise CommandError(f"--config {path}: cannot be read as YAML ({str(err).splitlines()[0]}).") from None
    if not isinstance(config, dict):
        raise CommandError(
            f"--config {path}: expected a mapping with model: and trainer:, got {type(config).__name__}."
        )
    return config


def build_on_meta(class_path: str, init_args: dict[str, Any], config_class: str | None = None) -> torch.nn.Module:
    """The model built on the meta device (no memory): ``cls(**init_args)``, or ``cls(config_cls(**init_args))``."""
    cls = load_class(class_path)
    config_cls = load_class(config_class, "--config-class") if config_class else None
    try:
        with torch.device("meta"):
            return cls(config_cls(**init_args)) if config_cls is not None else cls(**init_args)
    except (TypeError, ValueError) as err:
        raise CommandError(f"{class_path} cannot be built from {json.dumps(init_args)}: {err}") from None
