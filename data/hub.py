"""Whether the Hugging Face hub answers, asked once for the data scripts (prepare_eval.py,
prepare_rl.py, prepare_sft.py) before they read their first hub source.

Without network, datasets.load_dataset retries each hub source for about 24 s before it fails, so a
script reading four sources spent minutes finding out what one request says in two seconds. A run
that is offline by choice (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1: only the cache is read) is not
asked about, and HF_ENDPOINT is the hub asked, as the library does.
"""
import os
import threading
import urllib.error
import urllib.request

TRUE = ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether the datasets library reads only its cache: HF_DATASETS_OFFLINE when it is set, else
    HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE (datasets/config.py, huggingface_hub/constants.py)."""
    if os.environ.get("HF_DATASETS_OFFLINE") is not None:
        return os.environ["HF_DATASETS_OFFLINE"].upper() in TRUE
    hub = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return hub.upper() in TRUE


def unreachable(timeout: float = 2.0) -> str | None:
    """Why the hub cannot be reached, or None when it answers within `timeout` seconds (any HTTP
    status is an answer) or the run is offline by choice. The request runs in a thread so that a
    name lookup, which no socket timeout bounds, cannot hold the caller longer."""
    if offline():
        return None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    outcome = {}

    def ask():
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            outcome["error"] = None
        except urllib.error.HTTPError:  # (a status is an answer)
            outcome["error"] = None
        except (OSError, ValueError) as e:  # no route, no name, refused, a malformed HF_ENDPOINT
            outcome["error"] = e

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" not in outcome:
        return f"{endpoint} did not answer within {timeout:g} s"
    return None if outcome["error"] is None else f"{endpoint} cannot be reached ({outcome['error']})"


def hint(local: str) -> str:
    """What to do without network; `local` is the script's flag for a copy on disk of one source."""
    return f"without network, {local} reads a copy on disk and HF_HUB_OFFLINE=1 what an earlier run cached"
