"""A starting model's vocabulary grown by the tokens ``meshtrain prepare`` added (issue 51): prepared conversations
on a tokenizer without a chat template get ChatML's ``<|im_start|>`` and ``<|im_end|>`` as ids ``V, V+1`` after the
tokenizer's ``V`` (:mod:`meshtrain.data.chat`), and a model started from ``model.init_from`` with ``V`` embedding rows
has none for them. Fine-tuning it then builds the model with the larger vocabulary, padded as ``model.vocab_size = 0``
pads one (:func:`meshtrain.data.tokenizers.padded_vocab_size`: a multiple of 128 * tp), loads the checkpoint's rows
into the first ``V`` and initialises the new ones as ``transformers``' ``resize_token_embeddings`` does
(:mod:`meshtrain.models.resize`).

Only ids prepare added grow a vocabulary: any other id past the checkpoint's rows means data tokenized with another
tokenizer than the model's, and is refused before launch. Torch-free (the launcher's checks use it).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.data.tokenizers import padded_vocab_size

@dataclass(frozen=True)
class VocabGrowth:
    """How the run's vocabulary extends ``model.init_from``'s."""

    old: int
    """Rows of the checkpoint's embedding (its ``config.json`` ``vocab_size``, ``model.vocab_size`` of the run)."""
    new: int
    """Rows of the model built: the tokenizer's ids padded to a multiple of 128 * tp."""
    added: dict[int, str]
    """The ids prepare added (every id >= ``old`` the tokenizer has) -> their tokens."""

    def describe(self, folder: str, seed: int, sampled: bool) -> str:
        """The line a run says at start: the rows added and how they were initialised (``sampled``: drawn from the
        checkpoint rows' mean and covariance; else their mean, the covariance not being positive definite)."""
        tokens = ", ".join(f"{t} = {i}" for i, t in sorted(self.added.items()))
        pad = self.new - self.old - len(self.added)
        how = (f"drawn from N(mean, 1e-9 * covariance) of the checkpoint's rows with seed {seed} (train.seed)" if sampled
               else "set to the mean of the checkpoint's rows (their covariance is not positive definite)")
        return (f"vocabulary grown from {self.old} to {self.new} rows for the {len(self.added)} token(s) prepare added "
                f"({tokens}){f' and {pad} padding row(s)' if pad else ''}: the {self.new - self.old} new rows of the "
                f"embedding and the output head {how}, as transformers' resize_token_embeddings (mean_resizing) makes "
                f"them; '{folder}' holds the first {self.old}")


def _grown_modules(cfg: Config) -> list[str]:
    """The ``adapter.modules_to_save`` names of the embedding and the head, whose rows a grown vocabulary adds."""
    from meshtrain.adapters.saved import savable_modules

    return list(savable_modules(cfg.model))


def _rows_train(cfg: Config) -> bool:
    """Whether a LoRA run trains the new rows: the embedding and the head in ``adapter.modules_to_save`` (a tied head
    is the embedding: either name trains it, :func:`meshtrain.adapters.spec.saved_modules`)."""
    from meshtrain.adapters.saved import tied_embeddings

    named = set(cfg.adapter.modules_to_save) & set(_grown_modules(cfg))
    return named == set(_grown_modules(cfg)) or bool(named and tied_embeddings(cfg.model))


def vocab_growth(cfg: Config, n_tokens: int, added: dict[int, str]) -> VocabGrowth | None:
    """How the run grows ``model.init_from``'s vocabulary for a tokenizer of ``n_tokens`` ids of which ``added`` were
    added by prepare (:attr:`meshtrain.data.corpus.Corpus.added_tokens`); None without ``init_from`` or where the
    checkpoint's rows hold every id.

    Raises:
        ConfigError: ids past the checkpoint's rows that prepare did not add (data of another tokenizer), or LoRA
            adapters without the embedding and the head in ``adapter.modules_to_save``, which would leave the new rows
            frozen where they were initialised.
    """
    m = cfg.model
    if not m.init_from or n_tokens <= m.vocab_size:
        return None
    extra = range(m.vocab_size, n_tokens)
    if not all(i in added for i in extra):
        if cfg.data.tokenizer != "char":
            raise ConfigError(f"model.init_from = '{m.init_from}' has a vocabulary of {m.vocab_size} tokens, fewer than "
                              f"the {n_tokens} of data.tokenizer = '{cfg.data.tokenizer}': use the model's own "
                              f"tokenizer, --data.tokenizer '{m.init_from}'")
        own = f" (it added {len(added)}: ids {min(added)}-{max(added)})" if added else ""
        raise ConfigError(f"model.init_from = '{m.init_from}' has a vocabulary of {m.vocab_size} tokens, fewer than "
                          f"the {n_tokens} of data.path = '{cfg.data.resolved_path()}', and only tokens prepare added "
                          f"to the model's tokenizer can grow it{own}: prepare the data with the tokenizer the model "
                          f"was trained with")
    if cfg.adapter.lora_rank and not _rows_train(cfg):
        raise ConfigError(f"data.path = '{cfg.data.resolved_path()}' adds {len(extra)} token(s) to model.init_from = "
                          f"'{m.init_from}' ({m.vocab_size} rows), whose new rows LoRA would leave frozen where they "
                          f"were initialised: train the embedding and the head beside the adapters "
                          f"(adapter.modules_to_save = {_grown_modules(cfg)}), fine-tune without adapters "
                          f"(adapter.lora_rank = 0), or use a tokenizer that has the template's tokens")
    return VocabGrowth(m.vocab_size, padded_vocab_size(n_tokens, cfg.parallel.tp), {i: added[i] for i in extra})
