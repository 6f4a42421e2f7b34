"""Helpers for tests that run several learners in one process."""

import threading


def run_both(learners) -> None:
    """Run every learner's rounds at once, each on its own thread, as separate processes would."""
    threads = [threading.Thread(target=learner.run) for learner in learners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
