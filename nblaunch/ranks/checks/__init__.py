"""The rank side of the collective checks: what torch's groups know, the requests a rank waits on,
each call's record sent out of band, the flight recorder's reader, and debug mode's checks before a
call."""
