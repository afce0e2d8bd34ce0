"""The wakefl wire protocol, in one place: what a device and the server say to each other
over MQTT, and how it is read and checked. Both ends import it from here: the device
(wakefl.sdk) and the server (wakefl.server).

What the package owns:
- `frames`: the frame (b"WKFL" | sha256(body) | safetensors body) and its one header
  reader, used both by the decoder on untrusted bytes and by the server's store on the
  frames it recorded (server/recorded_updates.py);
- `messages`: the typed messages (Downlink, Uplink, Ack, Decline, Hello), the protocol
  version they carry (`PROTOCOL_VERSION`), their encoding, and their decoding with every
  refusal as a reject code; its parts are `message_types` (types, limits, reject codes),
  `message_checks` (field checks), `message_encode` and `message_decode`;
- `round_settings`: the typed, checked settings a downlink carries for its round;
- `records`: a strategy's named scalars as they travel (`ScalarSpec`, `RecordSchema`, the
  checks with their reject codes). A strategy declares its schema with these; the records'
  meaning (the Self-FL maths) stays in wakefl.sdk.selffl;
- `topics`: the MQTT topic layout and the id rules;
- `codec_names` and `update_codec`: the names of the update codecs and wire dtypes
  (without torch) and the codecs themselves (fp16 and int8 deltas).

What it leaves to each end: the server's store (server/state_store.py,
server/recorded_updates.py) keeps its own files, database and server-state format, and
reads recorded frames through `frames`; the MQTT connection (sdk/mqtt_link.py) is transport,
not format.

Dependencies: wakefl (errors, finite checks), torch, numpy and safetensors; never
wakefl.sdk, wakefl.server or wakefl.tools (tests/test_protocol_imports.py). The package
imports nothing on its own, so `topics` and `codec_names` stay free of torch.
"""
