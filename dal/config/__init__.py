"""Configuration plumbing shared by ``dal.hardware`` and ``dal.recipe`` (and ``dal.sparsity``).

- ``problems``: ``Problem`` (message, key path, file, line) and ``ConfigError``, which lists
  every problem of a file at once as ``file:line: key: message``;
- ``yaml_lines``: YAML loading that keeps the line of every key;
- ``fields``: ``Checker``, which collects problems while a parser walks a document;
- ``bundled``: where the YAML files shipped with dal are (package data or the repository);
- ``resolve``: bundled name / path / dict / object -> loaded config, for every kind;
- ``vocabulary``: words both schemas use (``GRANULARITIES``);
- ``nm_pattern``: the one parser of N:M sparsity patterns (``"2:4"``).

This layer sits at the top, next to ``dal.formats``: it imports only ``dal.formats.qformat`` from dal, and
nothing here imports torch.

    >>> from dal.config import parse_nm_pattern
    >>> parse_nm_pattern("2:4").density
    0.5
"""
from dal.config.bundled import bundled_dirs, bundled_names, find_bundled
from dal.config.fields import Checker
from dal.config.nm_pattern import (MAX_GROUP, NMPattern, canonical_nm_pattern, nm_pattern_problem,
                                   parse_nm_pattern)
from dal.config.problems import ConfigError, Problem, format_path
from dal.config.resolve import ConfigKind, load_config
from dal.config.vocabulary import GRANULARITIES
from dal.config.yaml_lines import YamlDoc, from_data, load_yaml_file, load_yaml_text

__all__ = [
    "Checker", "ConfigError", "ConfigKind", "GRANULARITIES", "MAX_GROUP", "NMPattern", "Problem", "YamlDoc",
    "bundled_dirs", "bundled_names", "canonical_nm_pattern", "find_bundled", "format_path", "from_data",
    "load_config", "load_yaml_file", "load_yaml_text", "nm_pattern_problem", "parse_nm_pattern",
]
