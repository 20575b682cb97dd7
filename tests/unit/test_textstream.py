from reame.engine.textstream import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> str:
    return "".join(stream.push(piece) for piece in pieces) + stream.flush()


def test_character_split_across_tokens_is_held_until_complete():
    stream = TextStream()
    e_acute = "é".encode()
    assert stream.push(b"caf" + e_acute[:1]) == "caf"
    assert stream.push(e_acute[1:]) == "é"


def test_four_byte_character_split_in_every_byte():
    stream = TextStream()
    emoji = "🙂".encode()
    assert [stream.push(bytes([b])) for b in emoji] == ["", "", "", "🙂"]


def test_unfinished_character_at_the_end_becomes_replacement_character():
    stream = TextStream()
    assert stream.push("é".encode()[:1]) == ""
    assert stream.flush() == "\ufffd"


def test_stop_string_split_across_tokens_is_not_emitted():
    stream = TextStream(stop=("END",))
    out = [stream.push(piece) for piece in (b"abc E", b"N", b"D tail")]
    assert "".join(out) == "abc "
    assert stream.stopped
    assert stream.flush() == ""


def test_text_that_only_looked_like_a_stop_prefix_is_released():
    stream = TextStream(stop=("END",))
    assert stream.push(b"xE") == "x"
    assert stream.push(b"NX") == "ENX"
    assert not stream.stopped


def test_held_stop_prefix_is_emitted_at_the_end():
    stream = TextStream(stop=("END",))
    assert stream.push(b"abEN") == "ab"
    assert stream.flush() == "EN"


def test_earliest_of_several_stop_strings_wins():
    assert feed(TextStream(stop=("zz", "b")), [b"a", b"bzz"]) == "a"


def test_stop_string_inside_one_token():
    stream = TextStream(stop=("\n\n",))
    assert stream.push(b"line\n\nnext") == "line"
    assert stream.stopped


def test_multibyte_stop_string_across_split_bytes():
    stream = TextStream(stop=("é!",))
    data = "xé!y".encode()
    assert feed(stream, [data[:2], data[2:3], data[3:]]) == "x"
