"""BranchCache: the stored branch of the conversations this process ran turns in, so the next
turn of one does not read its whole branch back from the database (the query, and building a
record per message, grow with the conversation).

An entry is the path root..reply of a conversation's last turn here, and the running summary
the turn read, tagged with the conversation's tree version the turn left
(`conversations.tree_version`: every change to the tree or the summary counts one, in SQL, and
a turn's start_reply exactly one). The next turn reads the conversation anyway; the entry is
used only if the version is still that one, so any change since (a message added or removed
by another route or replica, the leaf moved, a summary stored) makes it miss and the turn
reads the branch as before. A regenerate or an edit whose parent is on the cached path uses
the path up to it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvchat.app.store import ConversationRecord, MessageRecord, SummaryRecord

MAX_CONVERSATIONS = 2048


@dataclass(frozen=True)
class CachedBranch:
    tree_version: int
    path: tuple[MessageRecord, ...]  # root..the last turn's reply
    summary: SummaryRecord | None


class BranchCache:
    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.max_conversations = max_conversations
        self._entries: OrderedDict[str, CachedBranch] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(
        self, conv: ConversationRecord, parent: str | None
    ) -> tuple[list[MessageRecord], SummaryRecord | None] | None:
        """The path root..`parent` and the running summary, if the conversation is as this
        process's last turn left it; None: read them from the store."""
        entry = self._entries.get(conv.id)
        if entry is None or entry.tree_version != conv.tree_version or parent is None:
            self.misses += 1
            return None
        for index, message in enumerate(entry.path):
            if message.id == parent:
                self._entries.move_to_end(conv.id)
                self.hits += 1
                return list(entry.path[: index + 1]), entry.summary
        self.misses += 1
        return None

    def put(
        self,
        conv: ConversationRecord,
        path: tuple[MessageRecord, ...],
        new: tuple[MessageRecord, ...],
        summary: SummaryRecord | None,
    ) -> None:
        """After a stored turn that read `conv` (its tree version then) and `path`: the path
        with the turn's new messages (the user's, the stored reply), tagged with the version
        its start_reply made."""
        self._entries[conv.id] = CachedBranch(conv.tree_version + 1, (*path, *new), summary)
        self._entries.move_to_end(conv.id)
        while len(self._entries) > self.max_conversations:
            self._entries.popitem(last=False)

    def forget(self, conversation_id: str) -> None:
        self._entries.pop(conversation_id, None)
