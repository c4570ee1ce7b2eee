"""The LLM-judge fixture (tests/support/judge_model.py): a tiny Qwen2 that, given the judge prompt
for a repeat-task (prompt, response), writes round(9 * rule score) then its EOS. The repository
ships it (tests/data/judge_repeat, its FINGERPRINT this recipe's); a changed recipe builds it once
into the cache (about three minutes of one core)."""

from tests.support.judge_model import (JUDGE_PROMPT, RECIPE, SHIPPED, ensure_judge_model, judge_accuracy, judge_generate,
                                       read_verdict, verdict_for)
from spmdsplit.rewards.rule import positional_match_score

HELD_OUT = 12345
assert HELD_OUT != RECIPE["data_seed"]


def test_judge_scores_held_out_responses_like_the_rule():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_judge_model()
    assert path == SHIPPED, "the recipe changed: python -m tests.support.judge_model --ship writes the fixture anew"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert tokenizer.padding_side == "left"
    assert tokenizer.apply_chat_template(JUDGE_PROMPT, tokenize=False, add_generation_prompt=True) == (
        "<s>{prompt}{response}=")
    # "2815=" -> "5555": "5535" has 3 of 4 positions right, verdict round(6.75) = 7, then the EOS.
    assert verdict_for(positional_match_score("5535", "5555")) == 7
    [text] = judge_generate(model, tokenizer, [("2815=", "5535")])
    assert text == "7" and read_verdict(text) == 7
    assert judge_accuracy(path, 1000, seed=HELD_OUT) >= 0.9
