"""A seeded mix of prompts that share prefixes, the way a chat service's do: a few system
prompts shared by many conversations, second turns that repeat the first turn, and some
one-off prompts. Turns arrive over time, so a second turn finds its first turn's blocks
wherever kvcm has moved them by then (GPU, host or disk).
"""

from __future__ import annotations

import numpy as np

from kvcm_tiny_engine.engine import Request

__all__ = ["SYSTEM_PROMPTS", "chat_mix"]

SYSTEM_PROMPTS = (
    "You are a careful assistant for a hardware store. Answer in one short line, name the "
    "aisle, and never guess a price you do not know.\n",
    "You translate English into French. Keep names, numbers and units unchanged; answer "
    "with the translation alone.\n",
    "You are a terse code reviewer. Point at the first bug you see, quote the line, and "
    "say how to fix it in one sentence.\n",
)

QUESTIONS = (
    "Where are the hinges for a cabinet door?", "Do you sell M6 bolts by the box?",
    "The train leaves at 6 pm from platform 4.", "My cat sleeps on the warm laptop.",
    "for i in range(len(xs)): xs.remove(xs[i])", "if x = None: return",
    "Which glue holds ceramic to metal?", "Please send the 3 reports by Friday.",
)

FOLLOW_UPS = ("And how much is it?", "Now the same, but more politely.",
              "Why is that a bug?", "Anything else?")

CANNED_ANSWERS = ("Aisle 7, top shelf.", "Le train part a 18 h du quai 4.",
                  "Line 1 mutates the list it iterates.")


def chat_mix(num_chats: int = 8, *, max_new_tokens: int = 10, one_offs: int = 3,
             seed: int = 0) -> list[Request]:
    """First turns of ``num_chats`` conversations (round-robin over the system prompts),
    their second turns ``24`` steps later (first prompt, a canned answer, a follow-up),
    and ``one_offs`` unrelated prompts of random bytes in between."""
    rng = np.random.default_rng(seed)
    reqs = []
    for c in range(num_chats):
        first = SYSTEM_PROMPTS[c % len(SYSTEM_PROMPTS)] + "User: " + QUESTIONS[
            c % len(QUESTIONS)] + "\nAssistant:"
        reqs.append(Request(f"chat{c}-turn1", first, max_new_tokens=max_new_tokens,
                            arrival_step=2 * c))
        second = (first + " " + CANNED_ANSWERS[c % len(CANNED_ANSWERS)] + "\nUser: "
                  + FOLLOW_UPS[c % len(FOLLOW_UPS)] + "\nAssistant:")
        reqs.append(Request(f"chat{c}-turn2", second, max_new_tokens=max_new_tokens,
                            arrival_step=2 * c + 24))
    for i in range(one_offs):
        noise = rng.integers(32, 127, int(rng.integers(60, 140))).astype(np.uint8).tobytes()
        reqs.append(Request(f"oneoff{i}", list(noise), max_new_tokens=max_new_tokens,
                            arrival_step=int(rng.integers(0, 30))))
    return reqs
