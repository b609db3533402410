"""MMLU few-shot multiple-choice evaluation over the OpenAI completions API."""
