"""The files a model family touches (issue 49): the registry maps each architecture to the one module declaring it,
and no package module outside that family module names the family's Hugging Face or GGUF architecture strings --
except the config reader and the GGUF loader, for the per-family config and metadata logic still there
(``STILL_OUTSIDE``: that table may only shrink; adding a family adds no row to it)."""

import re
from pathlib import Path

import pytest

from kvserve.model import registry

PACKAGE = Path(__file__).resolve().parents[2] / "kvserve"

#: Family strings named outside their module today, where: the config reader's per-family windows, defaults and
#: RoPE aliases (hf_config), the GGUF loader's per-architecture metadata keys (loader); Llama's name is also
#: ``ModelArch``'s default and the transformers reference's class. The mixture-of-experts families have no row.
STILL_OUTSIDE = {
    "LlamaForCausalLM": {"model/base.py", "model/hf_reference.py"},
    **{a: {"model/hf_config.py"} for a in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM",
                                            "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")},
    **{f'"{g}"': {"model/loader.py"} for g in ("llama", "smollm3", "phi3", "olmo2", "gemma2", "gemma3")},
}

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
