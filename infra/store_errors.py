"""What a store request can fail with; every message names the object or setting at fault."""


class StoreError(RuntimeError):
    """The store cannot serve a request; the message names the object."""


class ObjectMissing(StoreError):
    pass


class ObjectExists(StoreError):
    pass


class IntegrityError(StoreError):
    """An object's bytes do not match the checksum recorded for them."""


class ObjectTooLarge(IntegrityError):
    """An object holds more bytes than its reader takes; it was not read whole, and is not read again."""
