"""A worker process of spmdsplit/usercode.py `Workers`: `python -m spmdsplit.usercode_worker PATH NAME`.

It loads NAME from the Python file PATH once, answers (True, None) (or (False, why) and exits), then
for each message of keyword arguments on stdin calls the function and answers (True, value) or
(False, the exception as one line). Messages are length-prefixed pickles (usercode.write_message).
What the function prints goes to stderr: the answers have the process's stdout to themselves.
"""

from __future__ import annotations

import os
import pickle
import sys


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")  # the answers' own copy of stdout
    os.dup2(2, 1)  # the function's prints (fd 1, sys.stdout) go to stderr
    questions = sys.stdin.buffer
    from spmdsplit.rewards.custom import load_custom_reward_fn
    from spmdsplit.usercode import error_line, read_message, write_message

    try:
        fn = load_custom_reward_fn(sys.argv[1], sys.argv[2])
    except Exception as e:  # noqa: BLE001 - said to the parent, which stops with it
        write_message(answers, (False, error_line(e)))
        return
    write_message(answers, (True, None))
    while True:
        try:
            kwargs = read_message(questions)
        except EOFError:
            return
        try:
            answer = (True, fn(**kwargs))
        except BaseException as e:  # noqa: BLE001 - the function's fault, answered; the worker goes on
            answer = (False, error_line(e))
        try:
            write_message(answers, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # a value that does not pickle
            write_message(answers, (False, f"the function returned what cannot be sent back: {error_line(e)}"))


if __name__ == "__main__":
    main()
