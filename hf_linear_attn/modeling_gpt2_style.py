"""GPT-2-style decoder with a pluggable causal attention: blocks, base model, causal-LM and classification heads.

The families (linear attention, causal block Linformer) supply their attention (``attend``) and their cache layer; the
init of what they add is :func:`~.weight_init.init_added_weights`. Everything else has GPT-2's layout and parameter
names (``transformer.wte``, ``transformer.h.N.attn.c_attn``, ``transformer.h.N.mlp.c_fc``, ``lm_head``...), so a
GPT-2 state dict maps one to one; the feed-forward is GPT-2's own.

Generation: the cache (:class:`~.recurrent_cache.RecurrentStateCache`) holds a state per layer, never one key / value
row per token. The base model is the one place that reads and writes it: each attention layer takes its previous
state in and hands the new state out. ``generate`` gets the cache from ``_prepare_cache_for_generation``; a direct
forward with ``use_cache`` creates one. Positions are padding-aware: without ``position_ids``, they are counted over
the real tokens of ``attention_mask``, so a left-padded prompt gets the positions it has alone.

Under ``torch.compile`` / ``torch.export`` the forward has no data-dependent Python branch: the checks that read
tensor values (position table bound, padding layout) run in eager mode only, and only where the shapes cannot
already prove them (:class:`~.explicit_state.DecoderStateStep` exposes the state as plain tensors for export).
"""


import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.pytorch_utils import Conv1D
from transformers.utils.generic import can_return_tuple

from .configuration_common import validate_config
from .decoder_inputs import DecoderInputChecks
from .recurrent_cache import RecurrentStateCache
from .sequence_classification import sequence_classification_loss
from .weight_init import init_added_weights


class GPT2StyleAttention(nn.Module):
    """GPT-2's fused q/k/v projection (`c_attn`) and output projection (`c_proj`) around a family's causal attention.

    Subclasses set ``cache_layer_class`` and implement ``attend`` on heads (B, H, n, d): it continues from the
    previous ``state`` (None: the first tokens) and returns the new state, plus, when asked, the per-token inputs of
    the state update (the tail a cache layer needs to roll back).
    """

    cache_layer_class = None
    # Whether q, k, v pass ``short_conv`` before the heads split: the last tensor of this layer's state is then the
    # convolution's buffer and the last of its rollback tail the convolution's inputs, the rest being attend()'s.
    has_short_conv = False
    # Whether the prompt pass (no earlier state) returns a state of fixed shapes, so that DecoderPrefill can export it
    # with a dynamic length; a family whose prompt pass keeps as many slots as blocks were completed sets False.
    fixed_shape_prompt_state = True

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.c_proj.is_residual_projection = True  # GPT-2's scaled init (see _init_weights)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    @staticmethod
    def build_shared_projection(config) -> nn.Module | None:
        """Parameters shared by every layer, owned by the base model; none by default."""
        return None

    def initial_state(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """This layer's state before any token, as tensors of fixed shapes (what :class:`DecoderStateStep` carries)."""
        raise NotImplementedError(f"{type(self).__name__} has no fixed-shape state to export or compile.")

    def explicit_state(self, tensors: tuple[torch.Tensor, ...]):
        """This layer's entry of :class:`DecoderStateStep`'s flat state, as ``attend`` takes it (as given, by default;
        a layer whose exported state differs from its generation cache's marks it here)."""
        return tensors

    def exported_prompt_state(self, state):
        """The state of a prompt pass (no earlier state) in the form ``initial_state`` has, for
        :class:`DecoderPrefill`: the same by default."""
        return state

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)

    def per_token_inputs(self, hidden_states: torch.Tensor) -> dict:
        """Extra keyword arguments of ``attend`` computed from the layer's input (B, n, D): none by default; the
        gate of gated linear attention (``log_decay``)."""
        return {}

    def normalize_output(self, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The heads' output (B, H, n, d) before they merge into ``c_proj``, given the layer's input: as is by
        default; the delta rule's output norm and gate (``delta_output_norm``)."""
        return output

    def short_conv(self, qkv, key_mask, buffer):
        """Token mixing of q, k, v, fused as ``c_attn`` returns them (B, n, 3 D), before the heads split, continuing
        from ``buffer`` (None: no earlier token); called where ``has_short_conv``. Returns (q, k, v fused (B, n, 3 D),
        the new buffer, the per-token inputs a rollback replays (B, n, .))."""
        raise NotImplementedError(f"{type(self).__name__} sets has_short_conv and must implement short_conv()")

    def split_conv_buffer(self, state) -> tuple:
        """(attend()'s state, the convolution's buffer) of a state whose last tensor is the buffer (has_short_conv)."""
        return tuple(state[:-1]), state[-1]

    def attend(self, q, k, v, key_mask, state, use_cache, need_tail, output_attentions, shared_projection):
        """The family's causal attention on heads (B, H, n, d), continuing from ``state`` (None: no earlier token).

        Returns (output (B, H, n, d), weights or None, new state or None (without ``use_cache``), tail or None
        (without ``need_tail``)).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")

    def forward(
        self, hidden_states, key_mask=None, state=None, use_cache=False, need_tail=False, output_attentions=False,
        shared_projection=None,
    ):
        if state is not None and output_attentions:
            raise ValueError(
                "output_attentions needs the whole sequence in one forward (no past_key_values): the recurrent state "
                "keeps no past keys. Call the model without past_key_values to inspect attention."
            )
        qkv = self.c_attn(hidden_states)
        if self.has_short_conv:  # the state's last tensor is the convolution's buffer, the rest is attend()'s
            state, buffer = (None, None) if state is None else self.split_conv_buffer(state)
            qkv, buffer, conv_inputs = self.short_conv(qkv, key_mask, buffer)
        q, k, v = (self._split_heads(t) for t in qkv.split(self.embed_dim, dim=-1))
        output, weights, state, tail = self.attend(
            q, k, v, key_mask, state, use_cache, need_tail, output_attentions, shared_projection,
            **self.per_token_inputs(hidden_states),
        )
        if self.has_short_conv:
            state = None if state is None else (*state, buffer)
            tail = None if tail is None else (*tail, conv_inputs)
        output = self.normalize_output(output, hidden_states).transpose(1, 2).reshape(hidden_states.shape)
        return self.resid_dropout(self.c_proj(output)), weights, state, tail


class GPT2StyleBlock(GradientCheckpointingLayer):
    """One pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (GPT-2's layout)."""

    def __init__(self, config, layer_idx: int, attention_class):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = attention_class(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config)
        self.mlp.c_proj.is_residual_projection = True

    def forward(
        self, hidden_states, key_mask=None, state=None, use_cache=False, need_tail=False, output_attentions=False,
        shared_projection=None,
    ):
        attn_output, weights, state, tail = self.attn(
            self.ln_1(hidden_states), key_mask, state, use_cache, need_tail, output_attentions, shared_projection
        )
        hidden_states = hidden_states + attn_output
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return hidden_states, weights, state, tail


class GPT2StylePreTrainedModel(PreTrainedModel):
    """Init, loading and generation plumbing shared by both decoder families."""

    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GPT2StyleBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    # Old GPT-2 checkpoints carry the causal-mask buffers of their attention: not weights, nothing to load.
    _keys_to_ignore_on_load_unexpected = [r"\.attn\.bias$", r"\.attn\.masked_bias$"]
    # Set by each family: its attention class and its bare model class, the one every head of the family builds
    # inside it.
    attention_class = None
    base_model_class = None

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """generate() must not build a key/value DynamicCache: the model brings its own state cache."""
        return False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Conv1D):
            # GPT-2's scaled init of the two projections per block that add to the residual stream. It is chosen
            # here, on the Conv1D itself: transformers skips the init of custom-code modules that hold no
            # parameters of their own (the attention and MLP modules), so a branch on those never runs.
            std = self.config.initializer_range
            if getattr(module, "is_residual_projection", False):
                std /= (2 * self.config.n_layer) ** 0.5
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
        init_added_weights(module, self.config)

    def check_key_mask(self, key_mask: torch.Tensor, has_past: bool) -> None:
        """Raise if this family cannot honour ``key_mask`` (batch, n) of the new tokens; every mask is fine by default."""



class GPT2StyleModel(DecoderInputChecks, GPT2StylePreTrainedModel):
    """The bare decoder: token and position embeddings, blocks, final LayerNorm."""

    def __init__(self, config):
        validate_config(config)  # again: a value assigned after the config was built is checked here
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPT2StyleBlock(config, i, self.attention_class) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.shared_projection = self.attention_class.build_shared_projection(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings

    def new_cache(self) -> RecurrentStateCache:
        """An empty cache for this model: one state layer per block (each attention names its own layer class)."""
        return RecurrentStateCache([block.attn.cache_layer_class() for block in self.h])

    def embed(self, input_ids, inputs_embeds, position_ids, token_type_ids=None) -> torch.Tensor:
        """Token + position (+ token type) embeddings, dropout applied: (B, n, n_embd)."""
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        hidden_states = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.dtype)
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids)
        return self.drop(hidden_states)

    def run_blocks(
        self, hidden_states, key_mask, states, use_cache=False, need_tails=False, output_attentions=False,
        output_hidden_states=False,
    ):
        """The blocks and the final LayerNorm on (B, n, n_embd), each block continuing from its entry of ``states``.

        Returns (hidden_states, new states (one per block, None without ``use_cache``), tails (per block, for
        rollback, None without ``need_tails``), all hidden states or None, all attentions or None).
        """
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        new_states, tails = [], []
        last = len(self.h) - 1
        for i, (block, state) in enumerate(zip(self.h, states)):
            hidden_states, weights, state, tail = block(
                hidden_states, key_mask=key_mask, state=state, use_cache=use_cache, need_tail=need_tails,
                output_attentions=output_attentions, shared_projection=self.shared_projection,
            )
            new_states.append(state)
            tails.append(tail)
            if output_hidden_states:
                all_hidden_states += (self.ln_f(hidden_states) if i == last else hidden_states,)
            if output_attentions:
                all_attentions += (weights,)
        return self.ln_f(hidden_states), new_states, tails, all_hidden_states, all_attentions

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: RecurrentStateCache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
    ) -> BaseModelOutputWithPast | tuple:
        """input_ids (batch, n) -> last_hidden_state (batch, n, n_embd) and, with use_cache, the updated state.

        ``return_dict=False`` (or ``config.return_dict = False``) returns the output's tuple instead.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        self._check_input_shape(input_ids, inputs_embeds)
        batch, n = input_ids.shape if inputs_embeds is None else inputs_embeds.shape[:2]
        device = input_ids.device if inputs_embeds is None else inputs_embeds.device
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if self.is_activation_checkpointing and self.training:
            use_cache = False  # recomputing a block in the backward pass would advance the state twice
        if past_key_values is not None:
            self._check_cache(past_key_values, batch)
        elif use_cache:
            past_key_values = self.new_cache()
        past_length = 0 if past_key_values is None else past_key_values.get_seq_length()

        position_ids, key_mask = self._positions_and_mask(attention_mask, position_ids, batch, n, past_length, device)
        if key_mask is not None and not torch.compiler.is_compiling():
            self.check_key_mask(key_mask, has_past=past_length > 0)
        hidden_states = self.embed(input_ids, inputs_embeds, position_ids, token_type_ids)

        # The one place the cache is read and written: states in, new states (and rollback tails) out.
        layers = past_key_values.layers if past_key_values is not None else None
        states = [layer.state for layer in layers] if layers is not None else [None] * len(self.h)
        need_tails = layers is not None and any(layer.record_past for layer in layers)
        hidden_states, new_states, tails, all_hidden_states, all_attentions = self.run_blocks(
            hidden_states, key_mask, states, use_cache=layers is not None, need_tails=need_tails,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        if layers is not None:
            for layer, state, tail in zip(layers, new_states, tails):
                layer.update(state, n, tail)

        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )


def check_compile_config(config) -> None:
    """Refuse a generate() compile config that would capture the decoding step in CUDA graphs (see
    ``GPT2StyleForCausalLM._valid_auto_compile_criteria``), naming the fix."""
    options = config.options or {}
    if config.mode in ("reduce-overhead", "max-autotune") or options.get("triton.cudagraphs"):
        raise ValueError(
            f"CompileConfig(mode={config.mode!r}) captures the decoding step in CUDA graphs, whose next replay "
            "overwrites the recurrent state this model's cache keeps between steps. Pass "
            "CompileConfig(mode='default') (or 'max-autotune-no-cudagraphs') to compile without them."
        )


class GPT2StyleForCausalLM(GPT2StylePreTrainedModel, GenerationMixin):
    """Decoder with GPT-2's language-model head, tied to the token embeddings; generates with a recurrent cache."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    # Trainer passes num_items_in_batch: with gradient accumulation the loss is then averaged over every token of the
    # accumulated batch, exactly as one large batch would be (a mean per micro-batch would weight tokens unequally).
    accepts_loss_kwargs = True

    def __init__(self, config):
        super().__init__(config)
        self.transformer = self.base_model_class(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        """generate() runs with this model's state cache, created here so that generate can prepare it: record its
        past for rollback (assisted decoding, a draft model's own cache) and compile a forward that uses it."""
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        model_kwargs["past_key_values"] = self.transformer.new_cache()
        if generation_config.is_assistant:
            model_kwargs["past_key_values"].activate_past_recording()

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """generate()'s inputs for the next forward: everything GenerationMixin forwards, as for stock GPT-2, so custom
        keyword arguments given to generate() reach ``forward`` (which takes and ignores those it does not know, as
        GPT-2's does). Positions are the one exception, left to the forward, which counts them over the attention mask
        (or the cache length) as generate() does: they then follow the input ids when token healing re-tokenizes the
        prompt, and are known to stay below the mask's length without reading a tensor value at every step.
        """
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        inputs.pop("position_ids", None)
        return inputs

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """Compile generate()'s decoding step only when asked (``compile_config``), never by default, and never with
        CUDA graphs.

        Transformers compiles the step on its own for a compileable cache on CUDA, with CUDA graphs ("reduce-overhead"):
        each replay writes its outputs into the same memory, and these caches keep a step's output state until the
        next step, which the replay has then overwritten (seen on an H200: "accessing tensor output of CUDAGraphs that
        has been overwritten by a subsequent run"). Asked for explicitly, compilation runs as the config says, except
        CUDA graphs on CUDA, refused with the fix.
        """
        config = generation_config.compile_config
        if config is None:
            return False
        if self.device.type == "cuda":
            check_compile_config(config)
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """The 2-D padding mask as it is: these decoders are causal by construction and take no 4-D mask (generate()
        would build one for a compileable cache)."""
        return attention_mask

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: RecurrentStateCache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """logits (batch, n, vocab); loss: next-token cross-entropy in float32, labels shifted inside (labels = input_ids,
        -100 ignored), averaged over the labelled tokens, or summed and divided by ``num_items_in_batch`` if given.
        ``shift_labels`` (batch, n): the targets already shifted (position t predicts shift_labels[t]), as Transformers'
        sequence-parallel training passes them; then ``labels`` may be omitted. ``kwargs``: what generate() forwards
        beyond these (its ``tokenizer`` for stop strings, a user's custom arguments); unused here, as in GPT-2, whose
        forward hands them to attention backends these decoders do not have. Trainer's loss scaling is unaffected:
        ``accepts_loss_kwargs`` says so explicitly."""
        outputs = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:] if logits_to_keep > 0 else hidden_states
        else:
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None or shift_labels is not None:
            loss = self.loss_function(
                logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=num_items_in_batch,
                shift_labels=shift_labels,
            )
        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )
        return output


class GPT2StyleForSequenceClassification(GPT2StylePreTrainedModel):
    """Decoder with a linear classifier (`score`) on the last real token of each sequence, as GPT-2."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = self.base_model_class(config)
        self.score = nn.Linear(config.n_embd, config.num_labels, bias=False)
        self.post_init()

    def _last_token(self, input_ids, attention_mask, batch, n, device):
        """Index (B,) of each row's last real token: from attention_mask, else the last non-pad token, as GPT-2."""
        positions = torch.arange(n, device=device)
        if attention_mask is not None:
            return (positions * attention_mask[:, -n:].to(device=device, dtype=torch.long)).argmax(-1)
        if self.config.pad_token_id is not None and input_ids is not None:
            return (positions * (input_ids != self.config.pad_token_id).to(device, torch.long)).argmax(-1)
        if batch != 1:
            raise ValueError(
                "Cannot find the last token of padded sequences: pass attention_mask, or set config.pad_token_id."
            )
        return torch.full((batch,), n - 1, device=device)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: RecurrentStateCache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
    ) -> SequenceClassifierOutputWithPast | tuple:
        """logits (batch, num_labels) at the last real token; loss chosen by config.problem_type, as in GPT-2."""
        outputs = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.score(outputs.last_hidden_state)
        batch, n = logits.shape[:2]
        last = self._last_token(input_ids, attention_mask, batch, n, logits.device)
        pooled_logits = logits[torch.arange(batch, device=logits.device), last]
        loss = None if labels is None else sequence_classification_loss(self.config, pooled_logits, labels.to(logits.device))
        output = SequenceClassifierOutputWithPast(
            loss=loss, logits=pooled_logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )
        return output
