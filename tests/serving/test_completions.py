"""The server's answers against generate() run in another process on the same checkpoint (one prompt at a time):
8 concurrent greedy requests of different lengths (batched) each get the tokens they get alone; the unmodified
`openai` client gets the same completions and chat completions, streamed and not; Megatron's PUT /api agrees with
/v1/completions; stop strings cut the text; a seeded sample repeats. One server for the session (conftest)."""
import threading

import pytest

from megatron.spawn import run_distributed

PROMPTS = ["The", "The game began development in 2010", "It met with positive sales in Japan , and was",
           "Valkyria", "In the", "A B C D E F G H I J K L", "and", "It was praised by both Japanese and western"]
NEW = [5, 12, 7, 9, 3, 11, 8, 6]     # max_tokens per prompt: every row its own length


def _greedy_alone(model_args, prompts, new):
    """Each prompt's greedy tokens with generate(), one prompt per call (no batching, no server)."""
    from megatron.text_generation import generate
    from megatron.text_generation.lm_eval_model import load_from_megatron_args
    model, tokenizer = load_from_megatron_args(model_args)
    ids = [tokenizer.tokenize(p) for p in prompts]
    outs = [generate(model, [p], n, greedy=True, eod_id=tokenizer.eod)[0] for p, n in zip(ids, new)]
    return [tokenizer.detokenize([t for t in out if t != tokenizer.eod]) for out in outs], ids


@pytest.fixture(scope="module")
def alone(checkpoint):
    return run_distributed(_greedy_alone, 1, args=(checkpoint.model_args, PROMPTS, NEW))[0]


def _complete(server, prompt, max_tokens, **fields):
    status, answer = server.post("/v1/completions", dict(prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                         **fields))
    assert status == 200, answer
    return answer


def test_concurrent_requests_get_what_they_get_alone(server, alone):
    texts, _ = alone
    answers = [None] * len(PROMPTS)
    batches_before = server.request("GET", "/health")[1]["batches"]

    def ask(i):
        answers[i] = _complete(server, PROMPTS[i], NEW[i])
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a["choices"][0]["text"] for a in answers] == texts
    assert [a["usage"]["prompt_tokens"] for a in answers] == [len(ids) for ids in alone[1]]
    _, health = server.request("GET", "/health")
    assert health["batches"] - batches_before < len(PROMPTS), health      # batched, not only queued


def test_token_id_prompts_and_list_prompts(server, alone):
    texts, ids = alone
    answer = _complete(server, [ids[1], ids[3]], 9)
    by_text = _complete(server, [PROMPTS[1], PROMPTS[3]], 9)
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in by_text["choices"]]
    assert by_text["choices"][1]["text"] == texts[3]                     # 9 tokens asked, 9 alone
    assert texts[1].startswith(by_text["choices"][0]["text"])          # 9 of the 12 tokens alone


def test_openai_client_completions_and_chat(server, alone):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=NEW[2], temperature=0)
    assert done.choices[0].text == alone[0][2] and done.usage.completion_tokens == NEW[2]
    stream = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=NEW[2], temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == alone[0][2]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                              stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert chat.choices[0].message.role == "assistant"
    assert "".join(pieces) == chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_chat_prompt_is_the_finetuning_format(server):
    """The messages become finetune_gpt.py's deepspeed-chat prompt: the same tokens as that text completed."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    status, chat = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert status == 200, chat
    text = _complete(server, " System: Be brief. Human: Hello Assistant:", 6)["choices"][0]["text"]
    assert chat["choices"][0]["message"]["content"] == text.removeprefix(" ")


def test_megatron_api_agrees_with_completions(server, alone):
    prompt = PROMPTS[1]
    status, api = server.request("PUT", "/api", {"prompts": [prompt], "tokens_to_generate": 6, "top_k": 1,
                                                 "logprobs": True})
    assert status == 200, api
    completion = _complete(server, prompt, 6, echo=True, logprobs=0)["choices"][0]
    assert api["text"][0] == completion["text"]
    assert api["segments"][0] == completion["logprobs"]["tokens"]
    assert api["logprobs"][0] == completion["logprobs"]["token_logprobs"][1:]
    status, bos = server.request("PUT", "/api", {"prompts": [prompt], "tokens_to_generate": 6, "top_k": 1,
                                                 "logprobs": True, "add_BOS": True})
    ids = [0] + alone[1][1]                                    # <|endoftext|> is id 0 in the embedded vocab
    after_eod = _complete(server, ids, 6, echo=True, logprobs=0)["choices"][0]["logprobs"]
    assert bos["segments"][0] == after_eod["tokens"] and bos["logprobs"][0] == after_eod["token_logprobs"][1:]


def test_stop_string_cuts_the_text(server, alone):
    full = alone[0][5]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    expected = full[:full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = server.stream("/v1/completions", {"prompt": PROMPTS[5], "max_tokens": NEW[5],
                                                       "temperature": 0, "stop": [stop], "stream": True})
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            choice = _complete(server, PROMPTS[5], NEW[5], stop=stop)["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (expected, "stop")


def test_seeded_sample_repeats(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 1.0, "top_k": 50, "seed": 11, "n": 3}
    first, again = server.post("/v1/completions", body)[1], server.post("/v1/completions", body)[1]
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1                                              # n choices are separate draws
    other = server.post("/v1/completions", dict(body, seed=12))[1]
    assert [c["text"] for c in other["choices"]] != texts
