"""GSM8K answer extraction and MMLU letter parsing on tricky generations; prompt building; CSV parsing."""
from decimal import Decimal
from pathlib import Path

import pytest

from arfusion.benchmarks.gsm8k import bench as gsm8k_bench
from arfusion.benchmarks.gsm8k import scoring as gsm8k
from arfusion.benchmarks.mmlu import bench as mmlu_bench
from arfusion.benchmarks.mmlu import scoring as mmlu

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("generation, expected", [
    ("She pays 3 * 4 = 12 dollars.\nThe answer is 12.", "12"),
    ("The answer is $1,234.50 in total.", "1234.5"),
    ("It drops to -5 degrees.", "-5"),
    ("The answer is −12.", "-12"),
    ("He loses -$40 overall", "-40"),
    ("Each costs $.75", "0.75"),
    ("So 10-3 = 7", "7"),                                   # subtraction, not a negative 3
    ("The total is 1,000,000 people.", "1000000"),
    ("They ran 2, 4, 6 laps", "6"),                          # a list is not a thousands group
    ("It took 5.5 hours.", "5.5"),                           # the final period is not a decimal point
    ("The answer is 42.\nAlso 7 and 9 were considered", "42"),  # the phrase wins over the last number
    ("the answer is: 8 apples; first we had 3", "8"),
    ("The answer is **9**.", "9"),
    ("The answer is \\boxed{16}.", "16"),
    ("The answer is 3 then the answer is 4", "3"),
    ("#### 72", "72"),
    ("The answer is unclear, but 5 + 6 = 11", "11"),         # no number after the phrase: last number
])
def test_gsm8k_extract_answer(generation, expected):
    assert gsm8k.extract_answer(generation) == Decimal(expected)


@pytest.mark.parametrize("generation", ["", "I do not know.", "The answer is seven.", "x2 y3"])
def test_gsm8k_no_number_is_invalid(generation):
    assert gsm8k.extract_answer(generation) is None
    assert not gsm8k.is_correct(None, Decimal(7))


@pytest.mark.parametrize("answer, label", [
    ("3 + 4 = <<3+4=7>>7\n#### 7", "7"), ("#### 1,900", "1900"), ("x\n#### -5", "-5"), ("#### 7.5", "7.5"),
])
def test_gsm8k_parse_label(answer, label):
    assert gsm8k.parse_label(answer) == Decimal(label)


def test_gsm8k_parse_label_without_marker_raises():
    with pytest.raises(ValueError, match="####"):
        gsm8k.parse_label("The result is 7")


@pytest.mark.parametrize("prediction, label, correct", [
    ("18", "18", True), ("18.00", "18", True), ("-5", "-5", True), ("5", "-5", False), ("7.5", "7.50", True),
])
def test_gsm8k_is_correct_compares_values(prediction, label, correct):
    assert gsm8k.is_correct(Decimal(prediction), Decimal(label)) is correct


def test_gsm8k_prompt_format():
    shots = gsm8k_bench.load_jsonl(FIXTURES / "gsm8k" / "train.jsonl")[:2]
    prompt = gsm8k.build_prompt(shots, "  How many legs do 3 cats have?  ")
    blocks = prompt.split("\n\n")
    assert len(blocks) == 3
    assert blocks[0] == ("Question: " + shots[0]["question"] + "\nAnswer: She had 5 * 8 = 40 crayons.\n"
                         "She has 40 - 10 = 30 left.\nThe answer is 30.")
    assert "<<" not in prompt and "####" not in prompt
    assert blocks[1].endswith("The answer is 7.")
    assert blocks[2] == "Question: How many legs do 3 cats have?\nAnswer:"
    assert gsm8k.build_prompt([], "Q?") == "Question: Q?\nAnswer:"


def test_gsm8k_paths_next_to_data(tmp_path):
    test, train = gsm8k_bench.resolve_paths(str(tmp_path / "test.jsonl"), None)
    assert train == tmp_path / "train.jsonl"
    assert gsm8k_bench.resolve_paths(str(test), "/x/shots.jsonl")[1] == Path("/x/shots.jsonl")


@pytest.mark.parametrize("generation, letter", [
    (" B", "B"), ("B.", "B"), ("Answer: B", "B"), ("(C)", "C"), (" d.", "D"), (" The answer is (D).", "D"),
    ("A", "A"), (" b)", "B"), ("a B", "B"), ("I'd pick c", "C"), ("\nC\n", "C"), ("C: 12", "C"),
])
def test_mmlu_parse_letter(generation, letter):
    assert mmlu.parse_letter(generation) == letter


@pytest.mark.parametrize("generation", ["", " none", "Banana", "ABCD", " E", "I'd"])
def test_mmlu_parse_letter_invalid(generation):
    assert mmlu.parse_letter(generation) is None


def test_mmlu_csv_quoted_commas_and_newlines():
    rows = mmlu.read_csv(FIXTURES / "mmlu" / "test" / "toy_arithmetic_test.csv")
    assert len(rows) == 5
    assert rows[1].options == ("3, 1, 2", "1, 2, 3", "2, 3, 1", "3, 2, 1")
    assert rows[2].question == "Consider the two statements below.\nStatement 1 | 2 is even. Statement 2 | 9 is prime."
    assert rows[4].question == 'What is "half" of 18?' and rows[4].options[3] == "9, or 3 squared"
    assert [r.answer for r in rows] == ["C", "B", "C", "A", "D"]


@pytest.mark.parametrize("content, error", [("q,a,b,c,d\n", "6 fields"), ("q,a,b,c,d,E\n", "not one of A-D")])
def test_mmlu_csv_malformed_rows_raise(tmp_path, content, error):
    path = tmp_path / "bad_test.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=error):
        mmlu.read_csv(path)


def test_mmlu_prompt_format():
    shots = mmlu.read_csv(FIXTURES / "mmlu" / "dev" / "toy_arithmetic_dev.csv")
    question = mmlu.read_csv(FIXTURES / "mmlu" / "test" / "toy_arithmetic_test.csv")[1]
    prompt = mmlu.build_prompt("toy_arithmetic", shots, question)
    assert prompt == (
        "The following are multiple choice questions (with answers) about toy arithmetic.\n\n"
        "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer: B\n\n"
        "Which number, of these, is odd?\nA. 4\nB. 8\nC. 10\nD. 7\nAnswer: D\n\n"
        "Which list is sorted in increasing order, from smallest to largest?\n"
        "A. 3, 1, 2\nB. 1, 2, 3\nC. 2, 3, 1\nD. 3, 2, 1\nAnswer:"
    )


def test_mmlu_load_subjects_filters_and_checks():
    data_dir = FIXTURES / "mmlu"
    assert mmlu_bench.list_subjects(data_dir) == ["toy_arithmetic", "world_facts"]
    [only] = mmlu_bench.load_subjects(data_dir, ["world_facts"], num_shots=1, examples=2)
    assert (only.name, len(only.shots), len(only.questions)) == ("world_facts", 1, 2)
    with pytest.raises(SystemExit, match="unknown subjects"):
        mmlu_bench.load_subjects(data_dir, ["astrology"], 0, None)
    with pytest.raises(SystemExit, match="only 2 rows"):
        mmlu_bench.load_subjects(data_dir, None, 5, None)
