"""Il Suggeritore on FakeBackend: it drafts what a grammar forces and what list structure predicts; greedy
output is identical with and without it, and its drafts are accepted."""

import json

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import EOS, IM_END, N_VOCAB, FakeBackend
from reame.structured.gbnf import compiled
from reame.structured.json_schema import schema_to_gbnf
from reame.speculative import Speculation
from reame.speculative.suggeritore import REMEMBERED_TEXTS, Suggeritore

from .test_speculative import FrozenCost

SCHEMA = {"type": "object", "properties": {"invoice_number": {"type": "string"}, "total_amount": {"type": "integer"},
                                           "currency": {"enum": ["EUR", "USD"]}},
          "required": ["invoice_number", "total_amount", "currency"]}
ANSWER = '{"invoice_number": "A-17", "total_amount": 420, "currency": "EUR"}'


def writes(answer: str):
    """A rule whose greedy choice writes `answer` after the prompt's last '>' , then ends the text."""
    target = answer.encode()

    def rule(history):
        start = max(i for i, token in enumerate(history) if token == ord(">")) + 1
        written = list(history[start:])
        logits = [0.0] * N_VOCAB
        following = target[len(written)] if len(written) < len(target) else EOS
        logits[following] = 10.0
        logits[IM_END] = -5.0
        return logits
    return rule


def suggeritore(backend):
    return Suggeritore(backend.token_piece, lambda text: backend.tokenize(text, add_special=False,
                                                                           parse_special=False), backend.detokenize)


def run(answer, grammar=None, speculate=True):
    backend = FakeBackend(n_ctx=2048, n_batch=256, rule=writes(answer))
    speculation = Speculation(suggeritore(backend), max_draft=16, cost=FrozenCost()) if speculate else None
    with Engine(backend, speculation=speculation) as engine:
        params = SamplingParams(temperature=0, max_tokens=300, grammar=grammar)
        result = engine.generate(GenerationRequest("answer>", params))
    return result, len(backend.decode_calls)


def test_the_text_a_schema_forces_is_drafted_and_accepted_with_identical_output():
    grammar = schema_to_gbnf(SCHEMA)
    plain, plain_steps = run(ANSWER, grammar, speculate=False)
    fast, fast_steps = run(ANSWER, grammar)
    assert json.loads(plain.text) == json.loads(ANSWER) and fast.tokens == plain.tokens
    usage = fast.finish.usage
    # The keys, quotes, colons and the rest of "EUR" are forced: about half the answer.
    assert usage.accepted_draft_tokens >= 30 and usage.accepted_draft_tokens == usage.draft_tokens
    assert fast_steps < plain_steps * 0.6


LIST = "1. apples\n2. pears\n3. plums\n4. figs\n- one\n- two\n- three\n| a | b |\n| c | d |\n    x = 1\n    y = 2\n"


def test_list_numbers_bullets_pipes_and_indentation_are_drafted_at_line_starts():
    plain, _ = run(LIST, speculate=False)
    fast, _ = run(LIST)
    assert fast.tokens == plain.tokens and fast.text == LIST
    # "2.", "3.", "4.", "-" twice, "|" and four spaces: what each line start repeats or counts on (a
    # wrong guess, "5." before the bullets, lowers the controller's estimate: some later ones wait unverified)
    assert fast.finish.usage.accepted_draft_tokens >= 8


def test_the_drafter_follows_the_answer_across_split_characters_and_lines():
    backend = FakeBackend()
    drafter = suggeritore(backend).drafter(backend.tokenize("Steps:\n1. wake"), None)
    assert drafter.propose(8) == []  # mid-line: nothing to predict
    drafter.observe(backend.tokenize(" up\n", add_special=False))
    assert backend.detokenize(drafter.propose(8)) == "2."
    drafter.observe(list("2. café\n".encode()))  # é arrives as two byte tokens
    assert backend.detokenize(drafter.propose(8)) == "3."
    grammar = schema_to_gbnf({"enum": ["administrator", "user"]})
    drafter = suggeritore(backend).drafter([], compiled(grammar))
    drafter.observe(list(b'"a'))
    assert backend.detokenize(drafter.propose(8)) == "dministr"  # at most the limit
    assert backend.detokenize(drafter.propose(20)) == 'dministrator"'


def test_a_block_closing_bracket_is_drafted_when_a_line_returns_to_its_openers_indentation():
    backend = FakeBackend()
    drafter = suggeritore(backend).drafter([], None)
    drafter.observe(list(b"    fn main() {\n        let x = f(1, [2, 3]);\n"))
    assert backend.detokenize(drafter.propose(8)) == "        "  # a line start: the indentation before
    drafter.observe(list(b"    "))
    assert backend.detokenize(drafter.propose(8)) == "}"  # back at the opener's indentation
    drafter.observe(list(b"}\n"))
    assert drafter.open_brackets == []
    drafter.observe(list(b"    "))
    assert drafter.propose(8) == []  # nothing left open


def test_closing_brackets_in_code_are_drafted_and_accepted_with_identical_output():
    code = "int main() {\n    int a[] = {\n        1,\n        2,\n    };\n    return a[0];\n}\n"
    plain, _ = run(code, speculate=False)
    fast, _ = run(code)
    assert fast.tokens == plain.tokens and fast.text == code
    assert fast.finish.usage.accepted_draft_tokens >= 4  # indentation three times and the "}" of the array


def test_a_draft_is_tokenized_as_inside_the_answer_up_to_the_tokens_that_would_merge_with_what_follows():
    vocabulary = ["|x", " x", "|", "  ", " ", "x", '"', "a"]  # longest match first, as merges would

    def tokenize(text):
        tokens = []
        while text:
            token = next(i for i, piece in enumerate(vocabulary) if text.startswith(piece))
            tokens.append(token)
            text = text[len(vocabulary[token]):]
        return tokens
    source = Suggeritore(lambda token: vocabulary[token].encode(), tokenize, lambda tokens: "")
    assert source.tokens_of("|", " x") == [vocabulary.index("|")]
    assert source.tokens_of("|", "x") == []  # "|x" is one token: the pipe alone is not what the model writes
    assert source.tokens_of('  "', "x") == [vocabulary.index("  "), vocabulary.index('"')]
    assert source.tokens_of("a ", "x") == [vocabulary.index("a")]  # the space goes with the word after it


def test_the_next_answer_to_the_same_schema_starts_from_the_layout_of_the_last():
    answer = '{\n  "invoice_number": "A-17",\n  "total_amount": 420,\n  "currency": "EUR"\n}'
    backend = FakeBackend(n_ctx=2048, n_batch=256, rule=writes(answer))
    source = suggeritore(backend)
    grammar = schema_to_gbnf(SCHEMA)
    with Engine(backend, speculation=Speculation(source, max_draft=16, cost=FrozenCost())) as engine:
        first, second = (engine.generate(GenerationRequest("answer>", SamplingParams(temperature=0, max_tokens=300,
                                                                                      grammar=grammar)))
                         for _ in range(2))
    assert first.text == second.text == answer
    # The first answer learns where the whitespace goes; the second knows from the start, so the line
    # breaks and indentation after '{' and the first ',' are drafted too, and no draft is refused.
    usage = second.finish.usage
    assert usage.accepted_draft_tokens == usage.draft_tokens >= first.finish.usage.accepted_draft_tokens + 6
    backend = FakeBackend(n_ctx=2048, n_batch=256, rule=writes(answer))
    other = suggeritore(backend).drafter([], compiled(grammar))
    assert other.grammar.habits == {}  # a new source knows nothing
    remembered = source.drafter([], compiled(grammar))
    # (Not before the number or after it: there the grammar leaves more than whitespace open.)
    assert remembered.grammar.habits == {'{"': "\n  ", ':"': " ", '",': "", ',"': "\n  ", '"}': "\n"}


def test_a_forced_text_is_tokenized_once_and_then_remembered():
    """Tokenizing is the dear part of a proposal (a regex pre-tokenizer: 0.35 ms on SmolLM2-135M), and a schema's
    keys come back at every answer: the same text gives the same tokens without asking the tokenizer again."""
    backend = FakeBackend()
    calls = []

    def tokenize(text):
        calls.append(text)
        return backend.tokenize(text, add_special=False, parse_special=False)
    source = Suggeritore(backend.token_piece, tokenize, backend.detokenize)
    first = source.tokens_of('", "b": ')
    first.append(0)  # the caller's list is its own
    assert source.tokens_of('", "b": ') == first[:-1] == backend.tokenize('", "b": ', add_special=False)
    assert calls == ['", "b": x']
    for n in range(REMEMBERED_TEXTS):
        source.tokens_of(str(n))
    source.tokens_of('", "b": ')
    assert calls[-1] == '", "b": x', "the oldest text was forgotten"
