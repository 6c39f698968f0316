"""The tools each specialist learns to call: OpenAI-style function schemas per domain.

Descriptions are kept short on purpose: the schemas are rendered into the system turn of a model whose
context is 1024 tokens.
"""

from __future__ import annotations

import copy
from typing import Any


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


CPP_STANDARDS: tuple[str, ...] = ("c++11", "c++14", "c++17", "c++20", "c++23")
CMAKE_CONFIGS: tuple[str, ...] = ("Debug", "Release", "RelWithDebInfo", "MinSizeRel")

TOOLS: dict[str, list[dict[str, Any]]] = {
    "cpp": [
        _tool(
            "lookup_symbol",
            "Find the declaration of a C or C++ symbol in the installed headers.",
            {
                "symbol": {"type": "string", "description": "Qualified name, e.g. std::vector::reserve"},
                "header": {"type": "string", "description": "Header to search, e.g. vector"},
            },
            ["symbol"],
        ),
        _tool(
            "compile_snippet",
            "Compile a C++ snippet with g++ -fsyntax-only and return the diagnostics.",
            {
                "code": {"type": "string", "description": "C++ source"},
                "std": {"type": "string", "enum": list(CPP_STANDARDS)},
            },
            ["code", "std"],
        ),
    ],
    "python": [
        _tool(
            "run_python",
            "Evaluate Python code and return its output.",
            {"code": {"type": "string", "description": "Python expression or statements"}},
            ["code"],
        ),
        _tool(
            "pydoc",
            "Show the signature and docstring of a Python module, class or function.",
            {"name": {"type": "string", "description": "Dotted name, e.g. json.dumps"}},
            ["name"],
        ),
    ],
    "build": [
        _tool(
            "cmake_build",
            "Build a target of a configured CMake project.",
            {
                "target": {"type": "string"},
                "build_dir": {"type": "string", "description": "Build directory, default build"},
                "config": {"type": "string", "enum": list(CMAKE_CONFIGS)},
            },
            ["target"],
        ),
        _tool(
            "make_target",
            "Run make for one target.",
            {
                "target": {"type": "string"},
                "jobs": {"type": "integer", "minimum": 1, "maximum": 64},
            },
            ["target"],
        ),
        _tool(
            "cmake_help",
            "Show the documentation of a CMake module.",
            {"module": {"type": "string", "description": "Module name, e.g. FindZLIB"}},
            ["module"],
        ),
    ],
    "shell": [
        _tool(
            "run_shell",
            "Run a shell command and return its output.",
            {
                "command": {"type": "string"},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600},
            },
            ["command"],
        ),
        _tool(
            "man_page",
            "Show the NAME and SYNOPSIS of a manual page.",
            {
                "name": {"type": "string"},
                "section": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            ["name"],
        ),
    ],
}


def tools_for(domain: str) -> list[dict[str, Any]]:
    """A fresh copy of the domain's tool schemas (callers may shuffle or trim it)."""
    if domain not in TOOLS:
        raise KeyError(f"unknown domain {domain!r}; expected one of {sorted(TOOLS)}")
    return copy.deepcopy(TOOLS[domain])


def tool_by_name(domain: str, name: str) -> dict[str, Any]:
    for tool in TOOLS[domain]:
        if tool["function"]["name"] == name:
            return copy.deepcopy(tool)
    raise KeyError(f"{domain} has no tool {name!r}")
