"""A user's reward module that takes a while to import (as one importing torch does on a busy machine)."""

import time

IMPORT_S = 1.5
time.sleep(IMPORT_S)


def one(prompt, completion, **sample):
    return 1.0
