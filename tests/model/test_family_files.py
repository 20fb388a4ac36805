"""The files a model family touches (issue 49): the registry maps each architecture to the one module declaring it,
and no package module outside that family module names the family's Hugging Face or GGUF architecture strings:
the config reader (``hf_config``) and the GGUF loader read what only one family reads through the hooks of its
``Family`` record (``kvserve.model.family``). ``STILL_OUTSIDE`` lists the exceptions: that table may only shrink;
adding a family adds no row to it."""

import re
from pathlib import Path

import pytest

from kvserve.model import registry

PACKAGE = Path(__file__).resolve().parents[2] / "kvserve"

#: Family strings named outside their module today: ``hf_reference`` builds ``transformers``' own
#: ``LlamaForCausalLM`` (the reference of the default model's family for parity checks and
#: ``bench throughput --compare transformers``): a class of ``transformers``, not the family's logic.
STILL_OUTSIDE = {"LlamaForCausalLM": {"model/hf_reference.py"}}

#: Registries that name their entries by vLLM's parser names, some of which are also GGUF architecture strings
#: ("qwen3", "granite", ...): a parser's name, not a model family's code.
PARSER_REGISTRIES = {"entrypoints/openai/reasoning_parsers.py", "entrypoints/openai/tool_parsers.py"}


def _files_naming(text: str) -> set:
    pattern = re.compile(re.escape(text))
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())} - \
        PARSER_REGISTRIES


def test_each_architecture_is_declared_by_one_family_module():
    declared = {}
    for module, family in registry.FAMILIES.items():
        assert module.startswith("kvserve.model.") and family.model.__module__ == module
        for arch in family.architectures:
            assert arch not in declared, (arch, module, declared.get(arch))
            declared[arch] = module
    assert tuple(declared) == registry.SUPPORTED_ARCHITECTURES
    assert set(registry.GGUF_ARCHITECTURES.values()) <= set(declared)


def _gguf_names(family) -> set:
    """The GGUF architectures a family reads: its own, and those it reads with ``<arch>.expert_count`` (Mixtral:
    ``llama``)."""
    return set(family.gguf_architectures) | set(family.experts.gguf if family.experts else ())


def _module_file(module: str) -> str:
    return "model/" + module.rsplit(".", 1)[1] + ".py"


@pytest.mark.parametrize("module", registry.FAMILY_MODULES)
def test_no_other_module_names_a_familys_architectures(module):
    family = registry.FAMILIES[module]
    for text in (*family.architectures, *(f'"{g}"' for g in sorted(_gguf_names(family)))):
        declaring = {_module_file(m) for m, f in registry.FAMILIES.items()
                     if text in f.architectures or text.strip('"') in _gguf_names(f)}
        outside = _files_naming(text) - declaring - {"model/registry.py"}
        assert outside <= STILL_OUTSIDE.get(text, set()), (text, sorted(outside))


def test_still_outside_lists_only_what_is_still_outside():
    """Each row of ``STILL_OUTSIDE`` is exactly where the string is still named (a fixed exception leaves no row)."""
    for text, files in STILL_OUTSIDE.items():
        declaring = {_module_file(m) for m, f in registry.FAMILIES.items()
                     if text in f.architectures or text.strip('"') in _gguf_names(f)}
        assert _files_naming(text) - declaring - {"model/registry.py"} == files, text
