// Says one text with GnuSpeech and writes a WAV file (tools/corpus/gnuspeech.py runs it).
// The @echogarden/gnuspeech-wasm package is read from the node_modules folder named by
// WAKEFL_GNUSPEECH_MODULES (scripts/install_gnuspeech.py). A speaker is one of the package's
// voices with its physical settings changed: `vocal_tract_length` (cm) and `breathiness` (%)
// override the voice file's, `pitch_offset` (semitones) and `tempo` the control model's;
// `seed` fixes the intonation's random draws.
// Usage: node gnuspeech_say.mjs '{"text": ..., "voice": ..., "tempo": ..., "pitch_offset": ...,
//        "vocal_tract_length": ..., "breathiness": ..., "seed": ..., "out": ...}'
import { writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'

const args = JSON.parse(process.argv[2])
// GnuSpeech draws its intonation's randomness from the runtime's random device: a generator
// seeded from the arguments (xorshift32) makes each rendering the same every time.
let state = (Number(args.seed) >>> 0) || 0x9e3779b9
const seeded = (view) => {
  const bytes = new Uint8Array(view.buffer, view.byteOffset, view.byteLength)
  for (let i = 0; i < bytes.length; i++) {
    state ^= state << 13; state >>>= 0
    state ^= state >>> 17
    state ^= state << 5; state >>>= 0
    bytes[i] = state & 0xff
  }
  return view
}
Object.defineProperty(globalThis, 'crypto', { value: { getRandomValues: seeded }, configurable: true })
const modules = process.env.WAKEFL_GNUSPEECH_MODULES
const pkg = join(modules, '@echogarden', 'gnuspeech-wasm')
const load = (p) => import(pathToFileURL(p).href)
const { wrapEmscriptenModuleHeap } = await load(join(modules, 'wasm-heap-manager', 'dist', 'exports', 'WasmHeapManager.js'))
const { defaultTrmControlModelFileContent } = await load(join(pkg, 'dist', 'utilities', 'DefaultTrmControlModel.js'))
const { default: initializer } = await load(join(pkg, 'wasm', 'gnuspeech.js'))

const m = await initializer()
const dataPath = '/data/en'
const setting = (content, key, value) => {
  const line = new RegExp(`^${key} = .*$`, 'm')
  if (!line.test(content)) throw new Error(`no setting ${key}`)
  return content.replace(line, `${key} = ${value}`)
}
let voice = new TextDecoder().decode(m.FS.readFile(`${dataPath}/voice_${args.voice}.txt`))
for (const key of ['vocal_tract_length', 'breathiness']) {
  if (args[key] !== undefined && args[key] !== null) voice = setting(voice, key, args[key])
}
m.FS.writeFile(`${dataPath}/voice_wakefl.txt`, voice)
let control = defaultTrmControlModelFileContent
control = setting(control, 'voice_name', 'wakefl')
control = setting(control, 'tempo', args.tempo)
control = setting(control, 'pitch_offset', args.pitch_offset)
m.FS.writeFile(`${dataPath}/trm_control_model.txt`, control)

const heap = wrapEmscriptenModuleHeap(m)
const refs = [args.text, './out.wav', dataPath, './out-params.txt'].map((s) => heap.allocNullTerminatedUtf8String(s))
m._GnuSpeech_synthesizeToFile(refs[0].address, refs[1].address, refs[2].address, refs[3].address, false)
writeFileSync(args.out, m.FS.readFile('./out.wav'))
for (const r of refs) r.free()
