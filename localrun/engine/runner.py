"""ModelRunner: turns a scheduled batch into flat tensors + one AttnMetadata, runs the model,
returns logits for the sequences that sample this step."""

from __future__ import annotations

import torch

from localrun.engine.attention import AttnMetadata
from localrun.engine.kv_pool import KVPool
from localrun.engine.model import LlamaModel
from localrun.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, device) -> None:
        self.model, self.pool, self.device = model, pool, torch.device(device)

    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, list[int]]:
        P = self.pool.page_size
        ids, pos, slots, seq_lens, prefix, q_lens, cu, sample_rows = [], [], [], [], [], [], [0], []
        max_pages = max(-(-(s.num_computed + n) // P) for s, n in zip(batch.seqs, batch.num_tokens))
        table = []
        for s, n in zip(batch.seqs, batch.num_tokens):
            start, end = s.num_computed, s.num_computed + n
            ids += s.token_ids[start:end]
            pos += range(start, end)
            pages = s.pages
            slots += [pages[p // P] * P + p % P for p in range(start, end)]
            table.append(pages[:max_pages] + [0] * (max_pages - min(len(pages), max_pages)))
            seq_lens.append(end)
            prefix.append(start)
            q_lens.append(n)
            cu.append(cu[-1] + n)
            if end == len(s.token_ids):
                sample_rows.append(cu[-1] - 1)
        meta = AttnMetadata(
            positions=self._tensor(pos, torch.long),
            slot_mapping=self._tensor(slots, torch.long),
            page_table=self._tensor(table, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            prefix_lens=self._tensor(prefix, torch.int32),
            num_decodes=batch.num_decodes,
            is_decode_only=batch.num_decodes == len(batch.seqs),
            seq_lens_list=seq_lens,
            q_lens_list=q_lens,
            k_caches=self.pool.k_caches,
            v_caches=self.pool.v_caches,
        )
        return self._tensor(ids, torch.long), meta.positions, meta, sample_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[int]]:
        """Logits [n_sampling, vocab] (float32) and, per row, the index into batch.seqs."""
        ids, pos, meta, rows = self.prepare(batch)
        hidden = self.model(ids, pos, meta)
        if not rows:
            return None, []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        ends = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)) if s.num_computed + n == len(s.token_ids)]
        return logits, ends

    @torch.inference_mode()
    def hidden_states(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Final hidden states of each sequence, with no KV cache (embeddings)."""
        cu = [0]
        for t in token_lists:
            cu.append(cu[-1] + len(t))
        meta = AttnMetadata(
            positions=self._tensor([p for t in token_lists for p in range(len(t))], torch.long),
            slot_mapping=None, page_table=None,
            seq_lens=self._tensor([len(t) for t in token_lists], torch.int32),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            prefix_lens=self._tensor([0] * len(token_lists), torch.int32),
            num_decodes=0, is_decode_only=False,
        )
        ids = self._tensor([x for t in token_lists for x in t], torch.long)
        h = self.model(ids, meta.positions, meta)
        return [h[a:b] for a, b in zip(cu[:-1], cu[1:])]
