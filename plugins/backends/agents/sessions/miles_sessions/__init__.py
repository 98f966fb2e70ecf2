"""Miles session server: token-in-token-out chat sessions over an SGLang-native engine."""

from miles_sessions.appender import Appender, NotAppendOnly, TurnText
from miles_sessions.store import Session, SessionError, Turn

__all__ = ["Appender", "NotAppendOnly", "Session", "SessionError", "Turn", "TurnText"]
