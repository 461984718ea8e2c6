"""Any transformers AutoModelForCausalLM behind the interface the engine uses:
forward(input_ids, position_ids) -> final hidden states, plus lm_head, max_positions, vocab_size."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, why: str = "", offloaded: bool = False):
        super().__init__()
        self.hf_model = hf_model
        self.why = why   # why transformers runs this model rather than a native one, for the report
        self.offloaded = offloaded   # placed by accelerate's device_map (fastppl.models.hf_offload): not moved
        # GPT2LMHeadModel.transformer, LlamaForCausalLM.model, ...: the trunk without the output projection
        self.trunk = hf_model.base_model
        self.lm_head = hf_model.get_output_embeddings()
        config = hf_model.config
        self.config = config
        for unsupported in ("final_logit_softcapping", "logit_scale"):
            assert getattr(config, unsupported, None) in (None, 1.0), f"{unsupported} is not supported"

    @property
    def max_positions(self) -> int:
        config = self.config
        for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return 1 << 20

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        out = self.trunk(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state
