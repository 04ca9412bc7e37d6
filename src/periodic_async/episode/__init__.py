"""Episodes: multi-turn rollouts in which the model calls tools and an environment answers.

The room beside `reward/` and below the producer, built on TRL's protocol (`tools=`,
`environment_factory`, `get_reward`, `max_tool_calling_iterations`); the engines are asked only to
"continue from these ids". Its parts, in the order an episode meets them:

    protocol.py   tools and environments as TRL defines them, checked; calls off the loop, timed
    formats.py    tools in the prompt, tool calls parsed: the chat template's format or plain text
    continuer.py  the engine-facing interface: await continuer(Request) -> RequestOutput
    runner.py     G episodes of a group (and the groups of an iteration) run concurrently
    record.py     the contract: `Episode` (ids, turns, loss mask, counts), `EpisodeLimits`
    pack.py       a group of episodes as the trainer consumes it (shared prompt, loss mask)
    sampler.py    a run's requests as groups of episodes: specs, the continuer, runners, checks
    envs.py       built-in environments: a calculator with a verifier, long-tailed latency

Above it: the producer runs an iteration's groups as episodes through `EpisodeSampler` when the
run has an environment or tools (the `env` section, or the TRL drop-in's `tools=` /
`environment_factory`), the trainer takes `episode_group`'s loss mask (docs/episodes.md).
"""

from periodic_async.episode.continuer import Continuer, FeedContinuer, WaveContinuer
from periodic_async.episode.formats import (PlainTextFormat, TemplateFormat, ToolCall, encode_conversation, format_call,
                                           make_format)
from periodic_async.episode.pack import EpisodeGroup, episode_group, loss_mask_N
from periodic_async.episode.protocol import Environments, ProtocolError, tool_schema
from periodic_async.episode.record import Episode, EpisodeError, EpisodeLimits, Turn
from periodic_async.episode.runner import EpisodeRunner, GroupSpec, turn_seed
from periodic_async.episode.sampler import EpisodeSampler, episode_reward, episode_row

__all__ = ["Continuer", "FeedContinuer", "WaveContinuer", "PlainTextFormat", "TemplateFormat", "ToolCall",
           "encode_conversation", "format_call", "make_format", "EpisodeGroup", "episode_group", "loss_mask_N",
           "Environments", "ProtocolError", "tool_schema", "Episode", "EpisodeError", "EpisodeLimits", "Turn",
           "EpisodeRunner", "GroupSpec", "turn_seed", "EpisodeSampler", "episode_reward", "episode_row"]
