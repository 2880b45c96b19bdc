"""Which runtime class a checkpoint's `architectures` name routes to: ours, and what vLLM and SGLang register.

Documented, versioned table. The vLLM and SGLang names were read from these sources, at the commits named:
  vLLM   vllm/model_executor/models/registry.py, `_SPECULATIVE_DECODING_MODELS` and `_TEXT_GENERATION_MODELS`, at
         commit 0002bff0b6cb36a3c8a17364de3303664463c412 (architecture -> (module, class)); that commit registers
         no DFlash / DSpark drafter. The DFlash entry ("DFlashDraftModel": qwen3_dflash.DFlashQwen3ForCausalLM) is
         as third-party notes quote vLLM 0.25.0's registry, not read from vLLM's own source (marked below).
  SGLang python/sglang/srt/models/*.py `EntryClass` (SGLang registers each EntryClass under its class name):
         llama_eagle3.py LlamaForCausalLMEagle3, llama_eagle.py LlamaForCausalLMEagle, deepseek_nextn.py
         DeepseekV3ForCausalLMNextN, dflash.py DFlashDraftModel (commit 003b23d7388eabdfbfecd2610c7e228f9f6a2734),
         dspark.py Qwen3DSparkModel (commit 01f476234ab4ee99c7fb7cb31b68d31b6a7c54a8; its DSparkDraftModel class
         is a base, not an EntryClass, so "DSparkDraftModel" itself is not a registered architecture there),
         mimo.py MiMoForCausalLM (commit 14de7d3ba077bbed34a4b0f79202cd24faba592e).
  MTP    vLLM's registry entries "MiMoMTPModel" (mimo_mtp.MiMoMTP) and "DeepSeekMTPModel" (deepseek_mtp.DeepSeekMTP)
         as registry.py lists them; Qwen3NextMTP is the class name read from qwen3_next_mtp.py. verispec's MTP
         drafter runs these layouts with a Llama-family block (models/mtp_layout.py).
A name absent from an engine's table is None: that engine would refuse the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_VERSION = "vllm-project/vllm@0002bff0b6cb (registry.py); DFlash row: vLLM 0.25.0 as quoted by third parties"
SGLANG_VERSION = "sgl-project/sglang@003b23d7388e (dflash.py), @01f476234ab4 (dspark.py), EntryClass of each file"


@dataclass(frozen=True)
class Route:
    """Where one `architectures` name goes in each runtime."""

    architecture: str
    kind: str  # target | eagle | eagle3 | eagle3-export | dflash | dspark | mtp
    ours: str | None  # verispec's class (module.Class), None: verispec does not run this layout
    vllm: str | None  # vLLM's class (module.Class), None: not registered
    sglang: str | None  # SGLang's EntryClass, None: not registered
    note: str = ""


_ROUTES = (
    # targets: verispec's one decoder, by model_type; vLLM / SGLang have one class per family
    Route("LlamaForCausalLM", "target", "verispec.models.llama.LlamaModel[llama]", "llama.LlamaForCausalLM",
          "LlamaForCausalLM"),
    Route("MistralForCausalLM", "target", "verispec.models.llama.LlamaModel[mistral]", "llama.LlamaForCausalLM",
          "MistralForCausalLM"),
    Route("Qwen2ForCausalLM", "target", "verispec.models.llama.LlamaModel[qwen2]", "qwen2.Qwen2ForCausalLM",
          "Qwen2ForCausalLM"),
    Route("Qwen3ForCausalLM", "target", "verispec.models.llama.LlamaModel[qwen3]", "qwen3.Qwen3ForCausalLM",
          "Qwen3ForCausalLM"),
    Route("MiMoForCausalLM", "target", "verispec.models.llama.LlamaModel[qwen2]", "mimo.MiMoForCausalLM",
          "MiMoForCausalLM", "a Qwen2 decoder whose checkpoint also ships MTP layers (model.mtp_layers.*): --method mtp"),
    # drafters
    Route("VerispecEagle3Head", "eagle3", "verispec.drafters.eagle3.Eagle3Head", None, None,
          "verispec's training layout; `verispec train export-eagle3` writes the LlamaForCausalLMEagle3 layout"),
    Route("LlamaForCausalLMEagle3", "eagle3-export", "verispec.drafters.eagle3.Eagle3Head (via the export names)",
          "llama_eagle3.Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"),
    Route("Eagle3LlamaForCausalLM", "eagle3-export", None, "llama_eagle3.Eagle3LlamaForCausalLM", None),
    Route("EagleLlamaForCausalLM", "eagle", None, "llama_eagle.EagleLlamaForCausalLM", None,
          "EAGLE-1/2: one feature layer, no aux layers; verispec implements EAGLE-3 only"),
    Route("LlamaForCausalLMEagle", "eagle", None, None, "LlamaForCausalLMEagle",
          "EAGLE-1/2: one feature layer, no aux layers; verispec implements EAGLE-3 only"),
    Route("DFlashDraftModel", "dflash", "verispec.drafters.dflash_model.DFlashModel",
          "qwen3_dflash.DFlashQwen3ForCausalLM (vLLM 0.25.0, as quoted)", "DFlashDraftModel",
          "verispec's DFlash uses a learned mask embedding (no mask_token_id): weights differ from z-lab's layout"),
    Route("DSparkDraftModel", "dspark", "verispec.drafters.dflash_model.DFlashModel[dspark]", None, None,
          "SGLang registers DSpark as Qwen3DSparkModel"),
    Route("Qwen3DSparkModel", "dspark", None, None, "Qwen3DSparkModel"),
    Route("DeepSeekMTPModel", "mtp", "verispec.drafters.mtp.MTPHead[deepseek_v3]", "deepseek_mtp.DeepSeekMTP", None,
          "verispec runs the layout with a Llama-family block; DeepSeek-V3's own (MLA + MoE) is refused"),
    Route("DeepseekV3ForCausalLMNextN", "mtp", "verispec.drafters.mtp.MTPHead[deepseek_v3]", None,
          "DeepseekV3ForCausalLMNextN",
          "verispec runs the layout with a Llama-family block; DeepSeek-V3's own (MLA + MoE) is refused"),
    Route("MiMoMTPModel", "mtp", "verispec.drafters.mtp.MTPHead[mimo]", "mimo_mtp.MiMoMTP", None),
    Route("Qwen3NextMTP", "mtp", "verispec.drafters.mtp.MTPHead[qwen3_next]", "qwen3_next_mtp.Qwen3NextMTP", None,
          "vLLM's class as read from qwen3_next_mtp.py; Qwen3-Next's own block (gated attention, MoE) is refused"),
)
ROUTES: dict[str, Route] = {r.architecture: r for r in _ROUTES}

# the model_type each target architecture implies (HF's class <-> model_type pairing)
TARGET_MODEL_TYPES = {"LlamaForCausalLM": ("llama", "smollm2"), "MistralForCausalLM": ("mistral",),
                      "Qwen2ForCausalLM": ("qwen2",), "Qwen3ForCausalLM": ("qwen3",), "MiMoForCausalLM": ("mimo",)}
# the drafter kind each learned method loads
METHOD_KINDS = {"eagle3": ("eagle3", "eagle3-export"), "dflash": ("dflash",), "dspark": ("dspark",)}


def route(architecture: str) -> Route | None:
    return ROUTES.get(architecture)


def describe(r: Route) -> str:
    """One line: ours -> class; vLLM -> class; SGLang -> class (or 'not registered')."""
    def show(x: str | None) -> str:
        return x or "not registered"

    return f"ours {r.ours or 'not run by verispec'}; vLLM {show(r.vllm)}; SGLang {show(r.sglang)}"
